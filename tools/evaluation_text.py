"""Rebuild a default model's evaluation text: the validation split it was trained without.

    python tools/evaluation_text.py models/colibri-olmoe-stdlib OUT.txt

The split is train_default_model.py's own (is_validation over stdlib_files: one file in 20 of
the Python standard library's sources, chosen by a hash of its path), so the text is the
validation files of the Python the script runs on, each followed by <|endoftext|> as training
joined them; with the Python recorded in the model's training.json it is the same text the
model card measured (the script warns when the versions differ). colibri-perplexity then reads
it: ``colibri-perplexity PACK OUT.txt --base F32PACK``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_default_model import EOS, is_validation, stdlib_files  # noqa: E402


def validation_files() -> dict[str, str]:
    """{path relative to the standard library: text} of the validation split, in training's order."""
    root, files = stdlib_files()
    texts = {str(p.relative_to(root)): p.read_text(encoding="utf-8", errors="replace") for p in files}
    return {name: text for name, text in texts.items() if is_validation(name)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("model", type=Path, help="the model's checkpoint directory (its training.json)")
    parser.add_argument("out", type=Path, help="the text file to write")
    args = parser.parse_args(argv)
    training = json.loads((args.model / "training.json").read_text())
    trained_on = training["corpus"]["python_version"]
    if trained_on != platform.python_version():
        print(f"warning: {args.model} was trained on Python {trained_on}'s sources, these are "
              f"{platform.python_version()}'s: the split's files may differ", file=sys.stderr)
    files = validation_files()
    args.out.write_text("".join(text + EOS for text in files.values()), encoding="utf-8")
    print(f"{args.out}: {len(files)} validation files", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
