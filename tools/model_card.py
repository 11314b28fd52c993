"""Measure a default-model checkpoint and write its model card (README.md beside it).

    python tools/model_card.py models/colibri-olmoe-stdlib

Reads training.json written by train_default_model.py and measures, on the held-out
validation files: loss and perplexity next to an interpolated bigram baseline on the same
tokenization, and the routing statistics a cache designer needs — per-layer expert-usage
entropy and temporal locality (how often a token reuses an expert the previous token used
in the same layer), and top-expert coverage (the share of a layer's routed choices that its
most used 12.5 / 25 / 50 % of experts receive: what a cache that pinned the hottest experts of
that size would hit). Development-only (torch, transformers).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_default_model import SHAPE_REASONS, encode_split, is_validation, stdlib_files  # noqa: E402

COVERAGE_FRACTIONS = (0.125, 0.25, 0.5)  # of a layer's experts, for top-expert coverage


def corpus_ids(checkpoint: Path) -> tuple[np.ndarray, np.ndarray]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    root, files = stdlib_files()
    texts = {str(p.relative_to(root)): p.read_text(encoding="utf-8", errors="replace") for p in files}
    train = encode_split(tok, [t for n, t in texts.items() if not is_validation(n)])
    val = encode_split(tok, [t for n, t in texts.items() if is_validation(n)])
    return train, val


def bigram_perplexity(train: np.ndarray, val: np.ndarray, vocab: int) -> tuple[float, float]:
    """Perplexity of P(n|p) = λ·c(p,n)/c(p) + (1-λ)·P_unigram(n), λ chosen on the
    validation set itself (which flatters the baseline, never the model)."""
    unigram = (np.bincount(train, minlength=vocab) + 1.0) / (len(train) + vocab)
    pairs = train[:-1] * vocab + train[1:]
    keys, counts = np.unique(pairs, return_counts=True)
    prev_counts = np.bincount(train[:-1], minlength=vocab).astype(np.float64)
    val_pairs = val[:-1] * vocab + val[1:]
    pos = np.searchsorted(keys, val_pairs)
    found = (pos < len(keys)) & (keys[np.minimum(pos, len(keys) - 1)] == val_pairs)
    pair_count = np.where(found, counts[np.minimum(pos, len(keys) - 1)], 0)
    conditional = np.divide(pair_count, prev_counts[val[:-1]], out=np.zeros(len(val) - 1), where=prev_counts[val[:-1]] > 0)
    best = (math.inf, 0.0)
    for lam in np.linspace(0.0, 0.99, 100):
        nll = -np.mean(np.log(lam * conditional + (1 - lam) * unigram[val[1:]]))
        best = min(best, (float(nll), float(lam)))
    return math.exp(best[0]), best[1]


def model_measurements(checkpoint: Path, val: np.ndarray, context: int, max_windows: int) -> dict:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    cfg = model.config
    layers, experts, top_k = cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok
    usage = np.zeros((layers, experts))
    reuse = np.zeros(layers)
    reuse_n = 0
    losses = []
    with torch.no_grad():
        end = len(val) - context - 1 if not max_windows else min(len(val) - context - 1, max_windows * context)
        for start in range(0, end, context):
            window = torch.from_numpy(val[start : start + context + 1])[None]
            out = model(input_ids=window[:, :-1], labels=window[:, :-1], output_router_logits=True)
            losses.append(float(out.loss))
            for layer, logits in enumerate(out.router_logits):
                chosen = torch.topk(logits.float(), top_k, dim=-1).indices.numpy()  # (T, A)
                np.add.at(usage[layer], chosen.reshape(-1), 1)
                mask = np.zeros((chosen.shape[0], experts), dtype=bool)
                np.put_along_axis(mask, chosen, True, axis=1)
                reuse[layer] += (mask[1:] & mask[:-1]).sum() / top_k
            reuse_n += context - 1
    p = usage / usage.sum(axis=1, keepdims=True)
    entropy = -(p * np.log2(np.where(p > 0, p, 1))).sum(axis=1)
    loss = float(np.mean(losses))
    return {"val_loss": loss, "val_perplexity": math.exp(loss), "entropy_bits": entropy.tolist(),
            "max_entropy_bits": math.log2(experts), "reuse": (reuse / reuse_n).tolist(),
            "coverage": top_expert_coverage(p).tolist(),
            "reuse_if_random": top_k / experts, "layers": layers, "experts": experts, "top_k": top_k,
            "tokens_measured": reuse_n + len(losses)}


def top_expert_coverage(shares: np.ndarray) -> np.ndarray:
    """(L, F): the share of each layer's routed choices that go to its most used
    ceil(f * E) experts, for f in COVERAGE_FRACTIONS. `shares` (L, E) sums to 1 per layer."""
    ordered = np.cumsum(np.sort(shares, axis=1)[:, ::-1], axis=1)
    experts = shares.shape[1]
    return np.stack([ordered[:, math.ceil(f * experts) - 1] for f in COVERAGE_FRACTIONS], axis=1)


# Function headers in the style of the standard library, none copied from it.
HEADERS = [
    "def fibonacci(n):", "def read_config(path):", "def is_prime(number):", "def flatten(items):",
    "def parse_args(argv=None):", "def merge_dicts(first, second):", "def word_count(text):",
    "def find_files(root, suffix):", "def retry(func, attempts=3):", "def to_snake_case(name):",
    "def chunked(iterable, size):", "def median(values):", "def load_json(path, default=None):",
    "def escape_html(text):", "def unique(sequence):", "def gcd(a, b):", "def format_bytes(count):",
    "def copy_tree(source, destination):", "def timestamp(when=None):", "def close_all(handles):",
]
SAMPLING = {"temperature": 0.7, "top_p": 0.95, "max_tokens": 96}


def trim_to_complete_lines(text: str) -> str:
    return text[: text.rfind("\n") + 1] if "\n" in text else text


def completion_parse_rate(checkpoint: Path) -> dict:
    """Sample a continuation of each header through Colibri on the README's default pack and
    count how many parse as Python once cut back to the last complete line."""
    import ast
    import tempfile

    from colibrid.tools.convert.converter import convert
    from colibrid.tools.convert.quant_spec import parse_quant
    from colibrid.engine import load
    from colibrid.engine.generate import GenerationEvent
    from colibrid.engine.sampling import SamplingParams

    parsed, samples = 0, []
    with tempfile.TemporaryDirectory() as tmp:
        convert(checkpoint, Path(tmp) / "default.pack", parse_quant(None), progress=False)
        engine = load(Path(tmp) / "default.pack")
        for seed, header in enumerate(HEADERS):
            params = SamplingParams(seed=seed, **SAMPLING)
            # The header alone, as a user would type it: the tokenizer merges a newline with the
            # indentation after it, so a prompt ending in a bare newline asks for an unindented line.
            events = engine.generate(engine.prompt_ids(header, raw=True), params)
            text = header + "".join(e.text for e in events if isinstance(e, GenerationEvent))
            program = trim_to_complete_lines(text)
            try:
                ast.parse(program)
                parsed += 1
            except SyntaxError:
                pass
            samples.append(program)
    return {"parsed": parsed, "total": len(HEADERS), "sampling": SAMPLING, "samples": samples}


def parameter_counts(checkpoint: Path) -> tuple[int, int]:
    from colibrid.models import architecture_for
    from colibrid.models.model_config import parameter_counts as counts

    hf = json.loads((checkpoint / "config.json").read_text())
    arch = architecture_for(hf)
    return counts(arch.model_config(hf), arch.optional_tensors(hf))


def render(checkpoint: Path, training: dict, m: dict, bigram_ppl: float, lam: float, params: tuple[int, int],
           completions: dict) -> str:
    curve = training["curve"]
    final = curve[-1]
    corpus = training["corpus"]
    args = training["arguments"]
    why = SHAPE_REASONS[args.get("shape", "default")]
    seen_tokens = args["steps"] * args["batch"] * args["context"]
    passes = seen_tokens / training["train_tokens"]
    coverage_heads = " | ".join(f"top {f:.1%} of experts".replace(".0%", "%") for f in COVERAGE_FRACTIONS)
    rows = "\n".join(
        f"| {layer} | {m['entropy_bits'][layer]:.2f} of {m['max_entropy_bits']:.2f} | {m['reuse'][layer]:.3f} | "
        + " | ".join(f"{c:.3f}" for c in m["coverage"][layer]) + " |"
        for layer in range(m["layers"])
    )
    curve_rows = "\n".join(f"| {p['step']} | {p['train_loss']:.3f} | {p.get('val_loss', '')} |"
                           for p in curve if "val_loss" in p)
    return f"""# {checkpoint.name}

A small Mixture-of-Experts language model trained from scratch by Colibri, so that a fresh
install answers with real (if modest) language and real routing. OLMoE architecture,
{m['layers']} layers, {m['experts']} experts, top-{m['top_k']}.

| | |
|---|---|
| parameters | {params[0] / 1e6:.1f} M total, {params[1] / 1e6:.1f} M active per token |
| training data | {corpus['source']}: {corpus['files']} files of Python {corpus['python_version']} (file-list sha256 `{corpus['file_list_sha256'][:16]}…`) |
| data license | {corpus['license']} |
| split | one file in 20 held out for validation, chosen by a hash of its path |
| tokens | {training['train_tokens']:,} training, {training['validation_tokens']:,} validation (byte-level BPE, {training['arguments']['vocab']} tokens) |
| training command | `{training['command']}` |
| final training loss | {final['train_loss']:.3f} |
| validation loss | {m['val_loss']:.3f} (perplexity {m['val_perplexity']:.1f}) |
| bigram baseline | perplexity {bigram_ppl:.1f} on the same validation tokens (interpolated, λ = {lam:.2f}) |
| why this size | {why} ({training['curve'][-1]['elapsed_s'] / 60:.0f} minutes here) |

## Loss curve

The validation column is what training printed: the first 64 windows of 256 tokens of the
validation split (16k tokens); the validation loss above is measured over all of it.
{args['steps']:,} steps of {args['batch']} × {args['context']} tokens are {passes:.1f} passes over the
{training['train_tokens'] / 1e6:.1f} M training tokens; the more passes, the more of the library the
model memorises, and the wider the gap between training and validation loss.

| step | training loss | validation loss |
|---|---|---|
{curve_rows}

## Routing on the validation set

Usage entropy: how evenly a layer spreads tokens over its experts (log2 E = uniform).
Reuse: the share of a token's experts that the previous token also used in the same layer
(random routing would give {m['reuse_if_random']:.3f}) — the temporal locality an expert cache lives on.
Coverage: the share of the layer's routed choices that its most used experts receive — what a
cache pinning that many of the layer's hottest experts would hit (uniform routing would give
the fraction itself).

| layer | usage entropy (bits) | reuse | {coverage_heads} |
|---|---|---|{"---|" * len(COVERAGE_FRACTIONS)}
{rows}

## Sampled completions

{completions['parsed']} of {completions['total']} sampled continuations of function headers parse
as Python (`ast.parse`, after cutting back to the last complete line), sampled through Colibri
on the default pack (4-bit experts) with {", ".join(f"{k} {v}" for k, v in completions['sampling'].items())},
seeds 0–{completions['total'] - 1}. A report, not a test: the model is small and sometimes wanders. Two of them:

```python
{completions['samples'][0].rstrip()}
```

```python
{completions['samples'][1].rstrip()}
```

Measured with `python tools/model_card.py {checkpoint}` over {m['tokens_measured']:,} validation tokens.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--max-windows", type=int, default=0, help="validation windows to measure (0: all)")
    args = parser.parse_args(argv)
    checkpoint = Path(args.checkpoint)
    training = json.loads((checkpoint / "training.json").read_text())
    train, val = corpus_ids(checkpoint)
    bigram_ppl, lam = bigram_perplexity(train, val, int(json.loads((checkpoint / "config.json").read_text())["vocab_size"]))
    measurements = model_measurements(checkpoint, val, training["arguments"]["context"], args.max_windows)
    completions = completion_parse_rate(checkpoint)
    card = render(checkpoint, training, measurements, bigram_ppl, lam, parameter_counts(checkpoint), completions)
    (checkpoint / "README.md").write_text(card)
    print(json.dumps({"bigram_perplexity": bigram_ppl, **measurements,
                      "completions_parsed": f"{completions['parsed']}/{completions['total']}"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
