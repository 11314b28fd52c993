"""``colibri-verify PACK`` (also ``python -m colibrid.tools.verify_cli``): check a whole pack on
disk, without the daemon. What it checks and how it reads: colibrid/pack/verify.py.

Progress (bytes, MB/s, ETA) is drawn on stderr when stderr is a terminal; the findings and the
verdict go to stdout, or with --json one JSON object per line: `verify_damage` events as they
are found, `verify_progress` events about once a second, and a last `verified` event with the
whole report - the same events colibrictl verify --json prints from the daemon.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from colibrid import __version__
from colibrid.tools.convert.progress import format_duration
from colibrid.pack.verify import verify_pack
from colibrid.pack.verify_report import Damage, Progress, VerifyControls, VerifyReport

EXIT_CLEAN = 0
EXIT_DAMAGED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

DEFAULT_QUEUE_DEPTH = 16  # the daemon's io_queue_depth default: the loader's reads in flight

EPILOG = """\
checks:
  manifest.json  parsed strictly, consistent with its model (every tensor, every
                 expert record, in place), and its own SHA-256
  dense.bin      every tensor's CRC-32C, the file's SHA-256
  experts.bin    every expert record's CRC-32C, read as the daemon reads them
                 (O_DIRECT, --queue-depth reads in flight), the file's SHA-256;
                 on a pack converted with --device, the same of its experts
                 region on the block device found by its superblock (reported
                 as experts.device, a record also by its LBA)
  the rest       each tokenizer file's SHA-256
Packs converted before colibri-convert recorded SHA-256 digests are checked by
their checksums only (a note says so); re-convert to record them.

exit status:
  0    the pack is intact
  1    damage found (each finding names the file and where: layer, expert and
       offset of an expert record; name and offset of a dense tensor)
  2    usage error
  130  interrupted by Ctrl-C
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="colibri-verify", description="Check every byte of a Colibri pack against its manifest.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pack", help="the pack directory")
    parser.add_argument("--json", action="store_true", help="one JSON object per line on stdout (see above)")
    parser.add_argument("--quiet", action="store_true", help="no progress line, only the findings and the verdict")
    parser.add_argument("--queue-depth", type=int, default=DEFAULT_QUEUE_DEPTH, metavar="N",
                        help=f"expert reads in flight, 1..1024 (default {DEFAULT_QUEUE_DEPTH})")
    parser.add_argument("--max-mb-per-s", type=float, metavar="MB", help="read at most MB megabytes per second "
                        "(default: as fast as the disk goes)")
    parser.add_argument("--direct", choices=("try", "required", "off"), default="try",
                        help="O_DIRECT reads: try (default; buffered where the file system refuses them), "
                             "required, off")
    parser.add_argument("--version", action="version", version=f"colibri-verify {__version__}")
    return parser


class _ProgressLine:
    """One redrawn line on stderr: bytes done of the total, MB/s, ETA, the file being read."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label = label
        self.enabled = enabled
        self.drawn = False

    def draw(self, progress: Progress) -> None:
        if not self.enabled:
            return
        fraction = progress.bytes_done / progress.bytes_total if progress.bytes_total else 1.0
        bar = "#" * int(fraction * 30) + "." * (30 - int(fraction * 30))
        eta = format_duration(progress.eta_s) if progress.eta_s is not None else "?"
        sys.stderr.write(f"\rverifying {self.label} [{bar}] {fraction * 100:5.1f}% "
                         f"{progress.bytes_done / 2**30:.2f}/{progress.bytes_total / 2**30:.2f} GiB "
                         f"{progress.mb_per_s:7.1f} MB/s ETA {eta:>6} {progress.file:<24.24}")
        sys.stderr.flush()
        self.drawn = True

    def end(self) -> None:
        if self.drawn:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self.drawn = False


def _print_json(event: str, fields: dict) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def describe_report(report: VerifyReport) -> str:
    """The verdict line."""
    checked = sum(1 for status in report.files.values() if status in ("ok", "damaged"))
    size = f"{report.bytes_read / 2**20:.1f} MiB read in {report.seconds:.1f} s"
    if report.cancelled:
        return f"{report.pack}: verify stopped before the end ({size})"
    if report.clean:
        digests = ("every SHA-256 matches the manifest" if checked else "no SHA-256 recorded")
        return f"{report.pack}: intact ({size}; {digests})"
    return f"{report.pack}: DAMAGED: {len(report.damage)} finding(s) ({size}); re-convert or restore the pack"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="colibri-verify: warning: %(message)s")
    if not 1 <= args.queue_depth <= 1024:
        print(f"colibri-verify: error: --queue-depth must be in 1..1024, got {args.queue_depth}", file=sys.stderr)
        return EXIT_USAGE
    if args.max_mb_per_s is not None and not args.max_mb_per_s > 0:
        print(f"colibri-verify: error: --max-mb-per-s must be > 0, got {args.max_mb_per_s}", file=sys.stderr)
        return EXIT_USAGE
    line = _ProgressLine(args.pack, enabled=not args.quiet and sys.stderr.isatty())
    last_json_s = [float("-inf")]

    def on_progress(progress: Progress) -> None:
        line.draw(progress)
        if args.json and time.monotonic() - last_json_s[0] >= 1.0:
            last_json_s[0] = time.monotonic()
            _print_json("verify_progress", progress.to_json())

    def on_damage(damage: Damage) -> None:
        if args.json:
            _print_json("verify_damage", damage.to_json())
        else:
            line.end()
            print(f"DAMAGED {damage.message}", flush=True)

    controls = VerifyControls(on_progress=on_progress, on_damage=on_damage,
                              max_bytes_per_s=None if args.max_mb_per_s is None else args.max_mb_per_s * 1e6,
                              progress_interval_s=0.1)
    try:
        report = verify_pack(args.pack, queue_depth=args.queue_depth, direct=args.direct, controls=controls)
    except KeyboardInterrupt:
        line.end()
        print("colibri-verify: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    line.end()
    if args.json:
        _print_json("verified", report.to_json())
    else:
        for note in report.notes:
            print(f"note: {note}")
        print(describe_report(report))
    return EXIT_CLEAN if report.clean else EXIT_DAMAGED


if __name__ == "__main__":
    sys.exit(main())
