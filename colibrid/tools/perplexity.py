"""``colibri-perplexity PACK TEXT [--base PACK]`` (also ``python -m colibrid.tools.perplexity``):
how well a pack predicts a text, in the shape of llama.cpp's ``llama-perplexity
--kl-divergence`` so the numbers compare.

The text is cut into windows of --context tokens (colibrid/tools/quality.py: the windowing and
scoring rule, the statistics); the second half of each window is scored. With --base (the f32
conversion of the same checkpoint, say) both packs run on the same windows, and the report adds
the base's perplexity, dPPL, mean KL divergence of the base's next-token distribution to this
pack's, its 99th percentile, and top-1 agreement. Several windows run in each batched step of
the engine (Model.forward_batch: each routed expert is computed once for all their rows), so a
180k-token text takes minutes.

The report goes to stdout (--json: one JSON object); progress (windows, tokens/s, ETA) to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from colibrid import __version__
from colibrid.engine import Engine, load
from colibrid.engine.forward.model import StepInput
from colibrid.native.errors import ColibriError
from colibrid.pack.manifest import PackError
from colibrid.tools.convert.progress import format_duration
from colibrid.tools.quality import KL_PERCENTILE, Totals, score_window, scored_positions, windows

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

DEFAULT_CONTEXT = 512  # llama-perplexity's default -c
STEP_ROWS = 2048  # token rows per batched step: several windows share each expert's load
STEP_LOGIT_BYTES = 256 << 20  # and at most this much of (rows, V) float32 logits per step


def adds_bos(engine: Engine) -> int | None:
    """The BOS id when the pack's tokenizer puts one before a text (its post-processor), else None."""
    tokenizer = engine.tokenizer
    bos = tokenizer.bos_token_id
    return bos if bos is not None and tokenizer.encode("a", add_special_tokens=True)[:1] == [bos] else None


def windows_per_step(context: int, vocab_size: int, max_step_tokens: int) -> int:
    rows = min(STEP_ROWS, max(STEP_LOGIT_BYTES // (4 * vocab_size), 1))
    return max(1, rows // min(context, max_step_tokens))


def window_logits(engine: Engine, group: np.ndarray) -> list[np.ndarray]:
    """Each window's logits (S, V) of its scored rows (scored_positions), for the windows of
    ``group`` (W, N) run together: each step takes up to max_step_tokens tokens of every window,
    and the steps before the scored half ask for no logits."""
    model = engine.model
    context = group.shape[1]
    rows, _ = scored_positions(context)
    chunk = min(context, model.max_step_tokens)
    states = [model.new_state(context) for _ in group]
    parts: list[list[np.ndarray]] = [[] for _ in group]
    kept_from = None  # the window position of the first row kept
    for start in range(0, context, chunk):
        end = min(start + chunk, context)
        wanted = "all" if end > rows.start else None
        if wanted and kept_from is None:
            kept_from = start
        logits = model.forward_batch([StepInput(state, ids, wanted) for state, ids in zip(states, group[:, start:end])])
        if wanted:
            for part, rows_of_window in zip(parts, logits):
                part.append(rows_of_window)
    return [np.concatenate(part)[rows.start - kept_from:rows.stop - kept_from] for part in parts]


class ProgressLine:
    """Windows done, tokens/s and ETA on stderr: redrawn in place on a terminal, a line about
    every 10 s otherwise (a log)."""

    def __init__(self, total_windows: int, context: int, enabled: bool, stream=None) -> None:
        self.total = total_windows
        self.context = context
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.started = time.monotonic()
        self.last_line = self.started
        self.tty = self.stream.isatty()

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not self.tty and now - self.last_line < 10 and done < self.total:
            return
        self.last_line = now
        elapsed = max(now - self.started, 1e-9)
        tokens_per_s = done * self.context / elapsed
        eta = (self.total - done) * elapsed / done if done else 0.0
        line = (f"windows {done}/{self.total}, {tokens_per_s:,.0f} tokens/s, "
                f"elapsed {format_duration(elapsed)}, ETA {format_duration(eta)}")
        self.stream.write(f"\r{line}\033[K" if self.tty else line + "\n")
        if self.tty and done == self.total:
            self.stream.write("\n")
        self.stream.flush()


def measure(engine: Engine, token_ids: np.ndarray, context: int, base: Engine | None = None,
            max_windows: int | None = None, progress: ProgressLine | None = None) -> dict:
    """The report's numbers (Totals.summary) plus the windows, over ``token_ids`` (the text)."""
    all_windows = windows(token_ids, context, adds_bos(engine), max_windows)
    _, targets = scored_positions(context)
    totals = Totals()
    per_step = windows_per_step(context, engine.config.vocab_size, engine.model.max_step_tokens)
    started = time.monotonic()
    for first in range(0, all_windows.shape[0], per_step):
        group = all_windows[first:first + per_step]
        base_logits = window_logits(base, group) if base is not None else [None] * len(group)
        for window, logits, reference in zip(group, window_logits(engine, group), base_logits):
            base_scores, base_log_probs = score_window(reference, window[targets]) if reference is not None \
                else (None, None)
            scores, _ = score_window(logits, window[targets], base_log_probs)
            totals.add(scores, base_scores)
        if progress is not None:
            progress.update(first + len(group))
    seconds = time.monotonic() - started
    evaluated = all_windows.size * (2 if base is not None else 1)
    return {"context": context, "windows": int(all_windows.shape[0]), "text_tokens": int(np.asarray(token_ids).size),
            **totals.summary(), "seconds": round(seconds, 3), "tokens_per_s": round(evaluated / max(seconds, 1e-9), 1)}


def text_ids(engine: Engine, text: str) -> np.ndarray:
    """The text's token ids: the whole text at once, without special tokens added (a window's
    BOS is windows()' business); special-token text in it (<|endoftext|> between documents)
    becomes the special token."""
    return np.asarray(engine.tokenizer.encode(text, add_special_tokens=False), dtype=np.int64)


def format_report(report: dict) -> str:
    lines = [f"{report['windows']} windows of {report['context']} tokens, {report['scored_tokens']} tokens scored "
             f"(of the text's {report['text_tokens']}), {report['seconds']:.1f} s, {report['tokens_per_s']:,.0f} tokens/s",
             f"perplexity      {report['perplexity']:.4f} +/- {report['perplexity_error']:.4f}"]
    if "base_perplexity" in report:
        percentile = f"kl_p{KL_PERCENTILE:g}"
        lines += [f"base perplexity {report['base_perplexity']:.4f} +/- {report['base_perplexity_error']:.4f}",
                  f"dPPL            {report['dppl']:+.4f} (ratio {report['ppl_ratio']:.4f})",
                  f"mean KL         {report['kl_mean']:.6f}",
                  f"KL p{KL_PERCENTILE:g}          {report[percentile]:.6f} (max {report['kl_max']:.6f})",
                  f"top-1 agreement {100 * report['top1_agreement']:.2f} %"]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="colibri-perplexity",
        description="Perplexity of a pack over a text, in windows as llama-perplexity; with --base, "
                    "KL divergence, top-1 agreement and dPPL against a reference pack.")
    parser.add_argument("pack", help="the pack to measure")
    parser.add_argument("text", help="a UTF-8 text file (tools/evaluation_text.py writes the default models' own)")
    parser.add_argument("--base", metavar="PACK", help="the reference pack (e.g. the f32 conversion of the same checkpoint)")
    parser.add_argument("--context", "-c", metavar="N", type=int, default=DEFAULT_CONTEXT,
                        help=f"tokens per window; the second half of each is scored (default {DEFAULT_CONTEXT})")
    parser.add_argument("--windows", metavar="K", type=int, help="score the first K windows only (default: all)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    parser.add_argument("--version", action="version", version=f"colibri-perplexity {__version__}")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.windows is not None and args.windows < 1:
        print(f"colibri-perplexity: error: --windows must be >= 1, got {args.windows}", file=sys.stderr)
        return EXIT_USAGE
    try:
        text = Path(args.text).read_text(encoding="utf-8")
        engine = load(args.pack, max_context=args.context)
        base = load(args.base, max_context=args.context) if args.base else None
        for name, loaded in (("pack", engine), ("base", base)):
            if loaded is not None and loaded.max_context < args.context:
                raise ValueError(f"the {name}'s model takes at most {loaded.max_context} positions, "
                                 f"less than --context {args.context}")
        token_ids = text_ids(engine, text)
        if base is not None and (base.config.vocab_size != engine.config.vocab_size
                                 or not np.array_equal(text_ids(base, text), token_ids)):
            raise ValueError("the packs have different vocabularies (their tokenizers split the text differently "
                             "or their vocabulary sizes differ): KL divergence needs the same tokens")
        windows(token_ids, args.context)  # the error for a short text, before any model runs
        total = min(token_ids.shape[0] // args.context, args.windows or token_ids.shape[0])
        progress = ProgressLine(total, args.context, enabled=not args.quiet)
        report = measure(engine, token_ids, args.context, base, args.windows, progress)
    except (OSError, ValueError, PackError, ColibriError) as exc:
        print(f"colibri-perplexity: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130
    report = {"pack": args.pack, "base": args.base, "text": args.text, **report}
    print(json.dumps(report) if args.json else format_report(report))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
