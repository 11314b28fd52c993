"""Run a pack directly, without the daemon — for trying a conversion and for debugging.

    python -m colibrid.engine PACK "prompt"        (or the prompt on stdin)
"""

from __future__ import annotations

import argparse
import logging
import sys

from colibrid.engine import load
from colibrid.engine.generate import GenerationDone
from colibrid.engine.sampling import SamplingParams


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m colibrid.engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("pack", help="pack directory written by colibri-convert")
    parser.add_argument("prompt", nargs="?", help="prompt text (default: read stdin)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float,
                        help="0 = greedy (default: the model's generation_config.json, else greedy)")
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--system", default=None, help="system prompt (chat models)")
    parser.add_argument("--raw", action="store_true", help="no chat template")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    engine = load(args.pack)
    given = {k: v for k, v in vars(args).items() if k in ("temperature", "top_k", "top_p") and v is not None}
    params = SamplingParams(**{"temperature": 0.0, **engine.sampling_defaults, **given}, seed=args.seed,
                            max_tokens=args.max_tokens)
    written = ""  # the answer's last piece on stdout, for the final newline
    try:
        ids = engine.prompt_ids(prompt=prompt, system=args.system, raw=args.raw)
        for event in engine.generate(ids, params):
            if isinstance(event, GenerationDone):
                # Like colibrictl: the answer ends its line, so the shell's prompt (or the
                # next line of a file it is written to) does not run on after it.
                if written and not written.endswith("\n"):
                    sys.stdout.write("\n")
                    sys.stdout.flush()
                print(f"[{event.finish_reason}: {event.prompt_tokens} prompt tokens, {event.generated_tokens} generated, "
                      f"{event.decode_tokens_per_s:.1f} tok/s]", file=sys.stderr)
            else:
                sys.stdout.write(event.text)
                sys.stdout.flush()
                written = event.text or written
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
