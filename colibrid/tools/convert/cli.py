"""``colibri-convert SRC OUT``: the command-line front of the converter."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from colibrid import __version__
from colibrid.blockdev.safety import WriteOptions
from colibrid.tools.convert.converter import ConversionError, convert
from colibrid.tools.convert.quant_spec import DEFAULT_QUANT, TENSOR_CLASSES, TYPE_NAMES, parse_quant
from colibrid.models import supported_names
from colibrid.native import ColibriError, ThreadPool
from colibrid.pack.manifest import Manifest

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    defaults = ",".join(f"{c}={DEFAULT_QUANT[c]}" for c in TENSOR_CLASSES)
    parser = argparse.ArgumentParser(
        prog="colibri-convert",
        description="Convert a Hugging Face MoE checkpoint (safetensors) into a Colibri pack.",
        epilog=(
            f"Supported architectures: {', '.join(supported_names())}. "
            f"Types: {', '.join(TYPE_NAMES)}. Tensor classes: {', '.join(TENSOR_CLASSES)} "
            "(norms, biases and routers always stay f32). "
            f"Default: --quant {defaults}. Example: colibri-convert ./OLMoE-1B-7B ./olmoe.pack --quant experts=q8_0"
        ),
    )
    parser.add_argument("src", help="checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    parser.add_argument("out", help="pack directory to create")
    parser.add_argument("--quant", metavar="SPEC", default=None,
                        help=f"TYPE for every class, or CLASS=TYPE,... overriding the defaults ({defaults})")
    parser.add_argument("--align", type=int, default=4096, metavar="BYTES",
                        help="alignment of tensors and expert records, a power of two >= 4096 (default 4096)")
    parser.add_argument("--force", action="store_true",
                        help="replace OUT if it exists (and, with --device, another pack's experts on the device)")
    device = parser.add_argument_group(
        "experts on a raw block device",
        "With --device, the experts region (nearly all of the pack) is written straight to a partition, after a "
        "superblock that carries the pack's id; OUT gets the manifest, dense weights and tokenizer as usual. "
        "colibrid finds the device again by that superblock, whatever its name then. Refused, with the reason: "
        "a mounted or otherwise used device (swap, dm, md), one on the disk holding / or /boot, one that is "
        "read-only or smaller than the experts. See docs/format.md and docs/rawdev.md.")
    device.add_argument("--device", metavar="DEV", default=None,
                        help="block device (a partition, e.g. /dev/nvme0n1p3) to hold the experts region")
    device.add_argument("--force-overwrite", action="store_true",
                        help="overwrite a device that holds a file system, swap, RAID, LVM or LUKS signature")
    device.add_argument("--whole-disk", action="store_true",
                        help="allow a whole disk with a partition table (the table and every partition are lost)")
    parser.add_argument("--tokenizer-pattern", metavar="REGEX", default=None,
                        help="pre-tokenizer regex of a tiktoken tokenizer (tiktoken.model, as Kimi K2 ships) when its "
                             "tokenization_*.py does not give pat_str as a plain string; 'kimi-k2' names Kimi K2's")
    parser.add_argument("--threads", type=int, default=0, metavar="N",
                        help="quantize on N threads (default 0: one per CPU this process may use)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no summary")
    parser.add_argument("--version", action="version", version=f"colibri-convert {__version__}")
    return parser


def describe_experts(pack: Path) -> str:
    """'4 layers of 16 experts': the shape people compare with the model card, rather than the
    number of records (64), which reads like the model's expert count."""
    records = Manifest.read(pack).expert_records
    layers = len({record.layer for record in records})
    experts_per_layer = len({record.expert for record in records})
    return f"{layers} layer{'s' * (layers != 1)} of {experts_per_layer} expert{'s' * (experts_per_layer != 1)}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="colibri-convert: warning: %(message)s")
    try:
        quant = parse_quant(args.quant)
    except ValueError as exc:
        print(f"colibri-convert: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.threads < 0:
        print(f"colibri-convert: error: --threads must be >= 0, got {args.threads}", file=sys.stderr)
        return EXIT_USAGE
    if args.device is None and (args.force_overwrite or args.whole_disk):
        print("colibri-convert: error: --force-overwrite and --whole-disk apply to --device only", file=sys.stderr)
        return EXIT_USAGE
    device_options = WriteOptions(force_overwrite=args.force_overwrite, whole_disk=args.whole_disk,
                                  replace_pack=args.force)
    started = time.monotonic()
    try:
        with ThreadPool(args.threads or None) as pool:
            report = convert(args.src, args.out, quant, align=args.align, force=args.force,
                             progress=False if args.quiet else None, pool=pool,
                             tokenizer_pattern=args.tokenizer_pattern, device=args.device,
                             device_options=device_options)
    except (ConversionError, ColibriError, ValueError) as exc:
        print(f"colibri-convert: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        if args.device:
            print(f"colibri-convert: interrupted; nothing was written to {args.out}, and {args.device} holds no "
                  "pack (its superblock is written last)", file=sys.stderr)
        else:
            print("colibri-convert: interrupted; nothing was written to the destination", file=sys.stderr)
        return 130
    if not args.quiet:
        seconds = time.monotonic() - started
        print(
            f"wrote {report.out}: {report.architecture}, {describe_experts(Path(report.out))}, "
            f"dense {report.dense_bytes / 1e6:.1f} MB + experts {report.experts_bytes / 1e6:.1f} MB "
            + (f"on {report.device} " if report.device else "") +
            f"({', '.join(f'{c}={t}' for c, t in report.quantization.items())}) in {seconds:.1f}s "
            f"({report.params / max(report.seconds, 1e-6) / 1e6:.1f} M params/s)",
            file=sys.stderr,
        )
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
