"""``colibrictl verify``: have the daemon check its whole pack (docs/colibrictl.md).

In the foreground the daemon reads the pack while it has nothing else to do, streaming its
progress (drawn on stderr when that is a terminal) and each finding (on stdout), and ends
with the verdict. Ctrl-C or a closed connection stops it. ``--background`` starts a scrub at
a bandwidth cap that goes on without the client (`colibrictl status` shows it; ``--stop``
ends it). With ``--json`` every event is printed as one JSON object per line.
"""

from __future__ import annotations

import argparse
import sys

from colibrid.wire.client import Connection
from colibrid.wire.errors import RequestError
from colibrid.wire.events import VerifiedEvent, VerifyDamageEvent, VerifyProgressEvent

EXIT_DAMAGED = 65  # EX_DATAERR: the pack the daemon serves is damaged

EPILOG = """\
The daemon checks every expert record's and dense tensor's CRC-32C, the
manifest's consistency and each file's SHA-256 (as colibri-verify PACK does),
reading at idle I/O priority with its loader's queue depth. Every expert
record found damaged is marked: requests that need it fail at once with
pack_damaged, and `colibrictl status` lists it (pack damage).

foreground (the default): reads only while no request runs or waits, so
  serving is not slowed; progress on stderr (a terminal), findings on stdout.
  Ctrl-C stops it.
--background: goes on while requests run, at --max-mb-per-s (default 50),
  and after colibrictl exits; `colibrictl status` shows its progress and
  the last result, `colibrictl verify --stop` ends it.
Only root and colibrid's own user may verify (not_permitted otherwise).

exit status:
  0    the pack is intact (or the background verify was started / stopped)
  65   damage found (each finding names the file and where in it)
  1    the daemon refused (busy: a verify is already running; not_permitted)
  69, 76, 130  as for the other commands
"""


def add_parser(commands, common: argparse.ArgumentParser, run) -> None:
    verify = commands.add_parser("verify", parents=[common], help="check the daemon's whole pack",
                                 description="Check every byte of the pack the daemon serves.",
                                 epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = verify.add_mutually_exclusive_group()
    mode.add_argument("--background", action="store_true",
                      help="scrub in the background at a bandwidth cap, without waiting for it")
    mode.add_argument("--stop", action="store_true", help="stop the verify that runs")
    verify.add_argument("--max-mb-per-s", type=float, metavar="MB",
                        help="read at most MB megabytes per second (default: 50 in the background, "
                             "no cap in the foreground)")
    verify.set_defaults(run=run, parser=verify)


def max_mb_per_s(args: argparse.Namespace) -> float | None:
    """--max-mb-per-s, checked (a usage error needs no daemon); None when not given."""
    if args.max_mb_per_s is not None and not args.max_mb_per_s > 0:
        args.parser.error("--max-mb-per-s must be > 0")
    return args.max_mb_per_s


class ProgressLine:
    """The verify's progress redrawn on one line of stderr (a terminal only)."""

    def __init__(self) -> None:
        self.enabled = sys.stderr.isatty()
        self.drawn = False

    def draw(self, event: VerifyProgressEvent) -> None:
        if not self.enabled:
            return
        done, total = event.bytes_done, event.bytes_total
        fraction = done / total if total else 0.0
        eta = event.eta_s
        state = "paused while requests run" if event.paused else \
            f"{event.mb_per_s:.1f} MB/s, ETA {'?' if eta is None else f'{eta:.0f} s'}"
        sys.stderr.write(f"\rverifying: {fraction * 100:5.1f}% of {total / 2**30:.2f} GiB, {state}, "
                         f"{event.file[:24]:<24}")
        sys.stderr.flush()
        self.drawn = True

    def end(self) -> None:
        if self.drawn:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self.drawn = False


def follow(connection: Connection, request_id: int, as_json, emit, emit_json) -> int:
    """Print a foreground verify's events until `verified`; the exit code."""
    line = ProgressLine()
    try:
        for event in connection.events(request_id):
            if as_json:
                emit_json(event.to_wire())
            elif isinstance(event, VerifyProgressEvent):
                line.draw(event)
            elif isinstance(event, VerifyDamageEvent):
                line.end()
                emit(f"DAMAGED {event.message}\n")
            elif isinstance(event, VerifiedEvent):
                line.end()
                for note in event.notes:
                    emit(f"note: {note}\n")
                emit(_verdict(event) + "\n")
            if isinstance(event, VerifiedEvent):
                return 0 if event.clean else EXIT_DAMAGED
    except (RequestError, KeyboardInterrupt):
        line.end()
        raise
    return 0


def _verdict(event: VerifiedEvent) -> str:
    size = f"{event.bytes_read / 2**20:.1f} MiB read in {event.seconds:.1f} s"
    if event.cancelled:
        return f"verify stopped before the end ({size})"
    if event.clean:
        return f"{event.pack}: intact ({size})"
    return (f"{event.pack}: DAMAGED: {event.damage_found} finding(s) "
            f"({size}); requests that need a damaged expert fail with pack_damaged; re-convert or restore the pack")
