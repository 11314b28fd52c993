"""``colibrictl top``: a live view of the daemon, like htop (q quits).

Two connections to the daemon: one subscribed to the `routing` stream (read by a thread into
a RoutingWindow: per-layer expert heat, cache hits and misses, router health), one asking
for `status` every interval (running requests and their tok/s, the queue, the expert
cache's read counters, the thermal watch). The screen is a list of lines made by
render_lines(), which --once prints as text; --json prints the same snapshot as JSON.

Read bandwidth is the expert cache's own byte counter (`cache.bytes_read` in status) over
the interval: the experts read from the pack, not other traffic on the device; "disk busy"
is the share of the interval the loader had a read in flight (`cache.read_busy_s`).

Standard library only (curses): the client installs without the daemon's dependencies.
"""

from __future__ import annotations

import argparse
import json
import locale
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from colibrictl import display
from colibrid.wire.client import Connection
from colibrid.wire.errors import ClientError, ProtocolViolation
from colibrid.wire.events import RoutingEvent, SubscribedEvent
from colibrid.wire.values import is_number
from colibrictl.router_health import LayerHealth, RoutingWindow

DEFAULT_INTERVAL_S = 1.0
DEFAULT_WINDOW_TOKENS = 256
# Events the reader thread may hold for the screen; it drains them every tick, so more only
# piles up when the screen is stuck, and then the oldest matter least.
MAX_QUEUED_EVENTS = 4096

UNICODE_LEVELS = " ▁▂▃▄▅▆▇█"
ASCII_LEVELS = " .:-=+*#%@"


# --------------------------------------------------------------------------------------------
# What is shown: a snapshot of status and routing
# --------------------------------------------------------------------------------------------


class RoutingFeed:
    """A subscription to the routing stream, read by a thread into a RoutingWindow."""

    def __init__(self, connection: Connection, window_tokens: int, collapse_share: float | None) -> None:
        self.connection = connection
        self.request_id = connection.subscribe("routing")
        events = connection.events(self.request_id)
        first = next(events)
        if not isinstance(first, SubscribedEvent):
            raise ProtocolViolation(f"expected a subscribed event, got {first.name!r}")
        self.window = RoutingWindow.from_subscribed(first, window_tokens, collapse_share)
        self._events = events
        self._lock = threading.Lock()
        self._queued: list[RoutingEvent] = []
        self._overflow = 0
        self.error: ClientError | None = None
        self._thread = threading.Thread(target=self._read, name="colibrictl-routing", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for event in self._events:
                if not isinstance(event, RoutingEvent):
                    break  # unsubscribed: the daemon is stopping
                with self._lock:
                    if len(self._queued) >= MAX_QUEUED_EVENTS:
                        self._queued.pop(0)
                        self._overflow += 1
                    self._queued.append(event)
        except ClientError as error:
            self.error = error
        except (OSError, ValueError):  # the socket closed under us as we quit
            pass

    def update(self) -> None:
        """Moves what the thread read into the window (on the caller's thread)."""
        with self._lock:
            events, self._queued = self._queued, []
            self.window.dropped += self._overflow
            self._overflow = 0
        for event in events:
            self.window.add(event)


@dataclass
class Snapshot:
    status: dict
    window: RoutingWindow
    interval_s: float = 0.0  # between the two status replies the rates come from
    read_bytes_per_s: float | None = None
    read_busy_fraction: float | None = None
    layers: list[LayerHealth] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @classmethod
    def take(cls, status: dict, previous: tuple[dict, float] | None, window: RoutingWindow,
             now_s: float) -> "Snapshot":
        snapshot = cls(status, window)
        cache = status.get("cache") if isinstance(status.get("cache"), dict) else {}
        if previous is not None:
            before, before_s = previous
            before_cache = before.get("cache") if isinstance(before.get("cache"), dict) else {}
            elapsed_s = now_s - before_s
            snapshot.interval_s = elapsed_s
            if elapsed_s > 0 and is_number(cache.get("bytes_read")) and is_number(before_cache.get("bytes_read")):
                snapshot.read_bytes_per_s = max(0.0, (cache["bytes_read"] - before_cache["bytes_read"]) / elapsed_s)
            if elapsed_s > 0 and is_number(cache.get("read_busy_s")) and is_number(before_cache.get("read_busy_s")):
                snapshot.read_busy_fraction = min(1.0, max(0.0, (cache["read_busy_s"] - before_cache["read_busy_s"])
                                                           / elapsed_s))
        snapshot.layers = window.layers()
        snapshot.warnings = window.warnings(snapshot.layers)
        return snapshot

    def as_json(self) -> dict[str, Any]:
        status, cache = self.status, self.status.get("cache") or {}
        thermal = status.get("thermal") or {}
        hits, misses = cache.get("hits"), cache.get("misses")
        return {
            "event": "top", "model": status.get("model"), "uptime_s": status.get("uptime_s"),
            "tokens_per_s": status.get("recent_tokens_per_s"),
            "running": status.get("running") or [], "queue_depth": status.get("queue_depth"),
            "queue_limit": status.get("queue_limit"),
            "io": {"read_bytes_per_s": self.read_bytes_per_s, "read_busy_fraction": self.read_busy_fraction,
                   "io_queue_depth": cache.get("io_queue_depth"),
                   "hit_rate": hits / (hits + misses) if isinstance(hits, int) and isinstance(misses, int)
                   and hits + misses else None, "interval_s": self.interval_s},
            "thermal": {"state": thermal.get("state"), "temperature_c": thermal.get("temperature_c"),
                        "reason": thermal.get("reason")},
            "window": {"tokens": self.window.tokens, "steps": self.window.steps,
                       "window_tokens": self.window.window_tokens, "dropped": self.window.dropped,
                       "num_experts": self.window.num_experts, "experts_per_token": self.window.top_k,
                       "collapse_share": self.window.collapse_share},
            "layers": [layer.as_json() for layer in self.layers],
            "warnings": self.warnings,
        }


# --------------------------------------------------------------------------------------------
# Drawing: lines of text, each with an emphasis ("title", "warn", "head" or None)
# --------------------------------------------------------------------------------------------


def heat_strip(counts: list[int], width: int, levels: str) -> str:
    """One character per expert (or per group of experts when there are more than ``width``),
    darker the more tokens chose it, relative to the layer's busiest expert."""
    if not counts or width < 1:
        return ""
    per_cell = -(-len(counts) // width)  # experts per character
    cells = [max(counts[i:i + per_cell]) for i in range(0, len(counts), per_cell)]
    top = max(cells)
    if top == 0:
        return " " * len(cells)
    steps = len(levels) - 1
    return "".join(levels[0] if c == 0 else levels[max(1, round(c / top * steps))] for c in cells)


def _rate(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:.1f}{unit}"


def render_lines(snapshot: Snapshot, width: int, height: int | None = None,
                 unicode_ok: bool = True) -> list[tuple[str, str | None]]:
    """The screen, top to bottom, each line at most ``width`` characters; with ``height``, the
    layer table is cut to fit (the header, warnings and requests come first)."""
    status, window = snapshot.status, snapshot.window
    cache = status.get("cache") if isinstance(status.get("cache"), dict) else {}
    thermal = status.get("thermal") if isinstance(status.get("thermal"), dict) else {}
    lines: list[tuple[str, str | None]] = []
    title = (f"colibrid {status.get('model', '?')} ({status.get('architecture', '?')})  up "
             f"{display.format_duration(status.get('uptime_s') or 0)}  "
             f"{_rate(status.get('recent_tokens_per_s'))} tok/s  "
             f"queue {status.get('queue_depth', '?')}/{status.get('queue_limit', '?')}  "
             f"running {status.get('requests_running', '?')}/{(status.get('batch') or {}).get('max_batch', '?')}"
             f"  [q quits]")
    lines.append((title, "title"))
    hits, misses = cache.get("hits"), cache.get("misses")
    hit_rate = (f"{100 * hits / (hits + misses):.1f} %" if isinstance(hits, int) and isinstance(misses, int)
                and hits + misses else "-")
    read = "-" if snapshot.read_bytes_per_s is None else display.format_bytes(snapshot.read_bytes_per_s) + "/s"
    busy = "-" if snapshot.read_busy_fraction is None else f"{100 * snapshot.read_busy_fraction:.0f} %"
    lines.append((f"expert reads {read} (cache byte counter), disk busy {busy}, reads in flight up to "
                  f"{cache.get('io_queue_depth', '-')}; cache hit rate {hit_rate}, "
                  f"{cache.get('resident_slots', '-')}/{cache.get('slots', '-')} slots", None))
    state = thermal.get("state", "off")
    temperature = thermal.get("temperature_c")
    thermal_line = f"thermal {state}" + (f" at {temperature:g} °C" if is_number(temperature) else "")
    if thermal.get("reason"):
        thermal_line += f": {thermal['reason']}"
    elif is_number(thermal.get("throttle_c")):
        thermal_line += f" (throttle at {thermal['throttle_c']:g} °C)"
    lines.append((thermal_line, "warn" if state in ("throttled", "critical", "device_missing") else None))
    for warning in snapshot.warnings:
        lines.append(("! " + warning, "warn"))
    running = status.get("running") or []
    lines.append(("", None))
    lines.append((f"{'REQUEST':<12} {'PHASE':<8} {'TOKENS':>7} {'TOK/S':>7}  PEER", "head"))
    for request in running:
        lines.append((f"{str(request.get('id'))[:12]:<12} {str(request.get('phase', '?')):<8} "
                      f"{request.get('tokens', 0):>7} {_rate(request.get('tokens_per_s')):>7}  "
                      f"{request.get('peer', '')}", None))
    if not running:
        lines.append(("(no request running)", None))
    lines.append(("", None))
    fixed = 6 + 1 + 6 + 7 + 7 + 8 + 9 + 6  # the columns around the strip
    strip_width = max(1, min(window.num_experts or 1, width - fixed - 2))
    lines.append((f"{'LAYER':>5}  {'HEAT':<{strip_width}} {'HIT%':>5} {'HITS':>6} {'MISS':>6} {'ENTROPY':>7} "
                  f"{'MAX/MEAN':>8}", "head"))
    levels = UNICODE_LEVELS if unicode_ok else ASCII_LEVELS
    table = []
    for layer in snapshot.layers:
        rate = (f"{100 * layer.hits / (layer.hits + layer.misses):.0f}" if layer.hits is not None
                and layer.misses is not None and layer.hits + layer.misses else "-")
        text = (f"{layer.layer:>5}  {heat_strip(layer.counts, strip_width, levels):<{strip_width}} {rate:>5} "
                f"{_count(layer.hits):>6} {_count(layer.misses):>6} "
                f"{'-' if layer.entropy is None else f'{layer.entropy:.2f}':>7} "
                f"{'-' if layer.imbalance is None else f'{layer.imbalance:.2f}':>8}")
        table.append((text, "warn" if layer.collapsed else None))
    footer = (f"heat: tokens per expert over the last {window.tokens} tokens ({window.steps} steps; window "
              f"{window.window_tokens}, {window.num_experts} experts, top-{window.top_k}), darkest = busiest"
              + (f"; {window.dropped} summaries dropped" if window.dropped else ""))
    if window.steps == 0:
        footer = "no steps seen yet: the routing appears when the daemon runs a request"
    if height is not None:
        room = height - len(lines) - 1
        if room < len(table):
            cut = len(table) - max(room - 1, 0)
            table = table[:max(room - 1, 0)] + ([(f"... {cut} more layers (a taller terminal shows them)", None)]
                                                 if room >= 1 else [])
    lines.extend(table)
    lines.append((footer, None))
    if height is not None:
        lines = lines[:max(height, 0)]
    return [(text[:max(width, 0)], emphasis) for text, emphasis in lines]


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


# --------------------------------------------------------------------------------------------
# Running it
# --------------------------------------------------------------------------------------------


class Top:
    """The two connections and the latest snapshot."""

    def __init__(self, connect, window_tokens: int, collapse_share: float | None) -> None:
        self.status_connection: Connection = connect()
        try:
            self.feed = RoutingFeed(connect(), window_tokens, collapse_share)
        except BaseException:
            self.status_connection.close()
            raise
        self._previous: tuple[dict, float] | None = None

    def snapshot(self) -> Snapshot:
        if self.feed.error is not None:
            raise self.feed.error
        status = self.status_connection.status().fields
        now_s = time.monotonic()
        self.feed.update()
        snapshot = Snapshot.take(status, self._previous, self.feed.window, now_s)
        self._previous = (status, now_s)
        return snapshot

    def close(self) -> None:
        self.feed.connection.close()
        self.status_connection.close()


def run_top(args: argparse.Namespace) -> int:
    from colibrictl.command import EXIT_OK, EXIT_USAGE, connect, wants_json

    if args.interval <= 0 or args.window < 1:
        args.parser.error("--interval must be > 0 and --window >= 1")
    if args.collapse_share is not None and not 0 < args.collapse_share <= 1:
        args.parser.error("--collapse-share must be in (0, 1]")
    scripted = args.once or wants_json(args)
    if not scripted and not (sys.stdout.isatty() and sys.stdin.isatty()):
        print("colibrictl: top needs a terminal; use --once or --json in scripts", file=sys.stderr)
        return EXIT_USAGE
    top = Top(lambda: connect(args), args.window, args.collapse_share)
    try:
        if scripted:
            _run_scripted(top, args, wants_json(args))
        else:
            _run_curses(top, args.interval)
    finally:
        top.close()
    return EXIT_OK


def _run_scripted(top: Top, args: argparse.Namespace, as_json: bool) -> None:
    """A snapshot every interval (the first after one interval, so rates and routing have
    something to cover); --once stops after the first."""
    top.snapshot()
    while True:
        time.sleep(args.interval)
        snapshot = top.snapshot()
        if as_json:
            sys.stdout.write(json.dumps(snapshot.as_json(), ensure_ascii=False) + "\n")
        else:
            import shutil

            width = shutil.get_terminal_size((120, 40)).columns
            sys.stdout.write("\n".join(text for text, _ in render_lines(snapshot, width, None, _unicode_ok())) + "\n")
        sys.stdout.flush()
        if args.once:
            return


def _unicode_ok() -> bool:
    encoding = (getattr(sys.stdout, "encoding", None) or locale.getpreferredencoding(False) or "").lower()
    return "utf" in encoding


def _run_curses(top: Top, interval_s: float) -> None:
    import curses

    locale.setlocale(locale.LC_ALL, "")  # so curses draws the heat's block characters
    unicode_ok = _unicode_ok()

    def loop(screen) -> None:
        try:
            curses.curs_set(0)
        except curses.error:
            pass  # a terminal without a cursor setting
        colors = _color_attributes(curses)
        screen.timeout(100)  # ms: keys are seen at once, the screen redraws every interval
        snapshot = top.snapshot()
        next_s = time.monotonic() + interval_s
        redraw = True
        while True:
            key = screen.getch()
            if key in (ord("q"), ord("Q"), 27):  # q, like htop; Esc too
                return
            if key == curses.KEY_RESIZE:
                redraw = True
            if time.monotonic() >= next_s:
                snapshot = top.snapshot()
                next_s = time.monotonic() + interval_s
                redraw = True
            if redraw:
                _draw(curses, screen, snapshot, colors, unicode_ok)
                redraw = False

    curses.wrapper(loop)


def _color_attributes(curses) -> dict[str | None, int]:
    attributes = {None: curses.A_NORMAL, "title": curses.A_REVERSE, "head": curses.A_BOLD, "warn": curses.A_BOLD}
    try:
        if curses.has_colors():
            curses.start_color()
            curses.use_default_colors()
            curses.init_pair(1, curses.COLOR_RED, -1)
            attributes["warn"] = curses.color_pair(1) | curses.A_BOLD
    except curses.error:
        pass
    return attributes


def _draw(curses, screen, snapshot: Snapshot, colors: dict, unicode_ok: bool) -> None:
    height, width = screen.getmaxyx()
    screen.erase()
    # The last column of the last line cannot be written without scrolling: stay clear of it.
    for y, (text, emphasis) in enumerate(render_lines(snapshot, max(width - 1, 0), height, unicode_ok)):
        try:
            screen.addstr(y, 0, text, colors.get(emphasis, curses.A_NORMAL))
        except curses.error:
            pass  # a terminal resized under us mid-draw: the next draw fits
    screen.refresh()


def add_top_parser(commands, common: argparse.ArgumentParser, epilog_class) -> None:
    top = commands.add_parser(
        "top", parents=[common], help="live view: requests, expert heat per layer, cache, disk, router health",
        description="A live full-screen view of the daemon, like htop (q quits): running requests and\n"
                    "tok/s, per-layer expert heat and cache hits/misses, expert read bandwidth and queue\n"
                    "depth, the thermal state, and the router's health per layer (entropy, max/mean load),\n"
                    "with a warning when a layer's routing collapses onto one expert.",
        epilog=TOP_EPILOG, formatter_class=epilog_class)
    top.add_argument("--once", action="store_true",
                     help="print one snapshot as text after one interval and exit (no terminal needed)")
    top.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S, metavar="SECONDS",
                     help=f"refresh every SECONDS (default {DEFAULT_INTERVAL_S:g}); rates are over it")
    top.add_argument("--window", type=int, default=DEFAULT_WINDOW_TOKENS, metavar="TOKENS",
                     help=f"heat and router health over at least the last TOKENS routed tokens "
                          f"(default {DEFAULT_WINDOW_TOKENS})")
    top.add_argument("--collapse-share", type=float, metavar="F",
                     help="warn when one expert is chosen by more than this fraction of a layer's tokens "
                          "(default: halfway between its fair share top_k/num_experts and 1)")
    top.set_defaults(run=run_top, parser=top)


TOP_EPILOG = """\
The screen:
  header   model, uptime, tokens/s over the last few seconds, queue and batch
  I/O      expert read bandwidth (the expert cache's byte counter over the
           interval: experts read from the pack, not other use of the device),
           disk busy (share of the interval with a read in flight), the
           loader's reads in flight, the cache's hit rate and slots
  thermal  the drive's thermal state and temperature (docs/thermal.md)
  ! ...    a layer whose routing collapsed: one expert chosen by more than the
           collapse share of the window's tokens (at least 32 tokens)
  requests each running request: phase, tokens so far, its decode tok/s
  layers   per MoE layer over the window: expert heat (a character per expert,
           or per group of experts on a narrow terminal; darker = chosen by
           more tokens, relative to the layer's busiest), cache hit %, hits and
           misses, routing entropy (1 = uniform) and max/mean expert load
           (1 = balanced; num_experts/top_k = one expert takes every token)

Keys: q (or Esc) quits. The screen follows the terminal's size.
--once prints one snapshot as text; --json prints one JSON object per interval
(--once --json: one), with the same fields, for scripts.
"""
