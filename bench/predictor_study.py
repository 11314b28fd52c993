"""Lookahead predictors on real routing: how well each guesses the next MoE layer's experts.

    python bench/predictor_study.py
    python bench/predictor_study.py --model /work/main/models/colibri-olmoe64-stdlib --per-layer --json out.json

Runs a trained model in-process (its pack converted on first use, as bench/routing_traces.py
does) on --sequences windows of its held-out validation text, greedily: each prompt is
prefilled in one step, then --generate tokens are decoded one step each, with the routing
capture on and keeping hidden states (each MoE layer's input rows and the residual stream after
it). Then, for every decode token and every MoE layer l but the last, each predictor's n best
guesses of layer l+1's experts are compared with the experts layer l+1 actually chose:

    recall     actual experts guessed / actual experts
    precision  guessed experts that were used / guessed experts
    over-fetch guessed experts / actual experts (n / top-k for a fixed-size guess)

at n = top-k x (1, 1.25, 1.5, 2), rounded, counted over tokens per layer and then averaged over
the layers (--per-layer prints each layer too). Decode tokens only: they are where the lookahead
reads land one token at a time; prompt rows only train the probe.

Predictors (guesses ranked best first):
  router-on-moe-input   layer l+1's router on layer l's MoE input: the engine's lookahead today
  router-on-residual    layer l+1's router on the residual stream after layer l through layer
                        l+1's pre-MoE norm: what layer l+1 would see if its attention added
                        nothing; known once layer l's experts have run, before l+1's attention
  probe                 a linear probe per layer: router-on-residual's logits plus a ridge
                        regression from the same normed residual to what layer l+1's attention
                        changes in its router logits (the residual is the latest state known
                        before l+1's attention, and in the router's input space the regression
                        only has to learn the correction; heavy ridge shrinks it to
                        router-on-residual). Fit on the first half of the windows (prompt and
                        decode rows; its ridge strength chosen on the last quarter of that half),
                        evaluated like every predictor on the second half only.
  probe-context         the same probe with more features: the previous token's MoE input at
                        layer l+1 (what layer l+1's attention mixes in comes from earlier
                        tokens, and that row summarises them where it matters). The engine would
                        keep it per sequence: D floats per MoE layer.
  previous-token        temporal locality alone: the experts layer l+1 chose for this
                        sequence's previous token, then the token before's, ... (the n most
                        recently used distinct experts; at n = top-k, exactly the previous token's)
  <p>+previous-token    the n guesses of p joined with the previous token's top-k (p:
                        probe-context, or router-on-residual where there is no probe): more than
                        n guesses, its over-fetch column says how many

Every predictor is evaluated on the same rows: the decode tokens of the second half of the
windows. Shape letters: L MoE layers, N rows (tokens), A top-k, D hidden, E experts, M guesses.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from routing_traces import DEFAULT_MODEL, PACK_DIR, ensure_pack, validation_windows  # noqa: E402

BUDGET_FACTORS = (1.0, 1.25, 1.5, 2.0)  # guesses per token, as multiples of top-k
RIDGE_ALPHAS = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)  # ridge strength x mean feature energy, chosen on held-out windows
MODEL_BASED = ("router-on-moe-input", "router-on-residual", "probe", "probe-context")


@dataclass
class Recording:
    """What a greedy run routed and the hidden states it routed on, every row of every step
    of every window in order."""

    experts: np.ndarray  # (L, N, A) int, each MoE layer's chosen experts per row, best first
    moe_inputs: np.ndarray  # (L, N, D) float32 each MoE layer's input rows
    residuals: np.ndarray  # (L, N, D) float32 the residual stream after each MoE layer
    sequence: np.ndarray  # (N,) int, the window each row belongs to
    decode: np.ndarray  # (N,) bool, the row was a decode step's (not the prompt's)

    @property
    def windows(self) -> int:
        return int(self.sequence.max()) + 1 if self.sequence.size else 0

    def fit_rows(self) -> np.ndarray:
        """(N,) bool: rows of the first half of the windows, where learned predictors fit."""
        return self.sequence < self.windows // 2

    def eval_rows(self) -> np.ndarray:
        """(N,) bool: decode rows of the second half of the windows, where every predictor is scored."""
        return (self.sequence >= self.windows // 2) & self.decode


def budgets(top_k: int, factors=BUDGET_FACTORS, num_experts: int | None = None) -> list[int]:
    """Guess counts n = top_k x factor, rounded half up, at most ``num_experts``, distinct, increasing."""
    return sorted({min(max(1, int(top_k * f + 0.5)), num_experts or 10**9) for f in factors})


def count_hits(guesses: np.ndarray, actual: np.ndarray) -> tuple[int, int, int]:
    """(hits, guessed, actual) summed over rows: ``guesses`` (N, M) distinct per row, -1 for
    no guess; ``actual`` (N, A) distinct per row."""
    made = guesses >= 0
    hits = ((guesses[:, :, None] == actual[:, None, :]) & made[:, :, None]).any(axis=2).sum()
    return int(hits), int(made.sum()), int(actual.size)


def join_guesses(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """(N, M1 + M2): ``first``'s guesses, then ``second``'s not already among them (-1 instead)."""
    repeated = (second[:, :, None] == first[:, None, :]).any(axis=2)
    return np.concatenate([first, np.where(repeated, -1, second)], axis=1)


def rank(scores: np.ndarray, n: int) -> np.ndarray:
    """(N, n) the n best experts of each row of ``scores`` (N, E), best first, the lower index on ties."""
    return np.argsort(-scores, axis=1, kind="stable")[:, :n]


def previous_rows(rows: np.ndarray, sequence: np.ndarray) -> np.ndarray:
    """(N, D): each row's previous row in its window, zeros for a window's first row."""
    out = np.zeros_like(rows)
    out[1:] = rows[:-1]
    out[1:][sequence[1:] != sequence[:-1]] = 0
    return out


def recent_experts(experts: np.ndarray, sequence: np.ndarray, n: int) -> np.ndarray:
    """(N, n): for each row, the n most recently chosen distinct experts of the rows before it
    in its window (the previous row's best first), -1 where the window has fewer."""
    out = np.full((experts.shape[0], n), -1, np.int64)
    for row in range(1, experts.shape[0]):
        guesses: list[int] = []
        previous = row - 1
        while previous >= 0 and sequence[previous] == sequence[row] and len(guesses) < n:
            guesses += [e for e in experts[previous].tolist() if e not in guesses]
            previous -= 1
        out[row, :min(n, len(guesses))] = guesses[:n]
    return out


# ---------------------------------------------------------------------------------------------
# The linear probe


@dataclass(frozen=True)
class Probe:
    """logits of layer l+1 ~ base logits + features @ weight + bias."""

    weight: np.ndarray  # (D, E) float64
    bias: np.ndarray  # (E,) float64
    alpha: float  # the ridge strength it was fit with, x mean feature energy

    def logits(self, features: np.ndarray, base: np.ndarray) -> np.ndarray:
        return base + features @ self.weight + self.bias


def fit_ridge(features: np.ndarray, targets: np.ndarray, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """Ridge regression with an unpenalised intercept: (weight (D, E), bias (E,)). The penalty is
    ``alpha`` times the mean squared feature, so alpha means the same for any hidden size."""
    x, y = features.astype(np.float64), targets.astype(np.float64)
    x_mean, y_mean = x.mean(axis=0), y.mean(axis=0)
    xc, yc = x - x_mean, y - y_mean
    penalty = alpha * max(float(np.einsum("nd,nd->", xc, xc)) / xc.shape[1], 1e-12)
    if xc.shape[0] < xc.shape[1]:  # fewer rows than features: the same solution through the (N, N) system
        weight = xc.T @ np.linalg.solve(xc @ xc.T + penalty * np.eye(xc.shape[0]), yc)
    else:
        weight = np.linalg.solve(xc.T @ xc + penalty * np.eye(xc.shape[1]), xc.T @ yc)  # (D, D) system
    return weight, y_mean - x_mean @ weight


def fit_probe(features: np.ndarray, base: np.ndarray, target: np.ndarray, actual: np.ndarray,
              sequence: np.ndarray, decode: np.ndarray, top_k: int) -> Probe:
    """A probe from fit rows only: ``features`` (N, D), ``base`` and ``target`` logits (N, E),
    ``actual`` (N, A) the chosen experts, ``sequence`` (N,) their windows. The ridge strength is
    the one with the best recall at top_k on the decode rows of the last quarter of the windows
    (at least one) when fit on the others; the probe is then refit on all of them."""
    windows = np.unique(sequence)
    held = windows[len(windows) - max(1, len(windows) // 4):]
    val = np.isin(sequence, held)
    train, score_rows = ~val, val & decode
    if not train.any() or not score_rows.any():
        raise ValueError("the probe needs at least two windows to fit on, and decode rows in the last")
    best_alpha, best_hits = RIDGE_ALPHAS[-1], -1
    for alpha in sorted(RIDGE_ALPHAS, reverse=True):  # ties keep the stronger ridge
        weight, bias = fit_ridge(features[train], target[train] - base[train], alpha)
        guesses = rank(base[score_rows] + features[score_rows] @ weight + bias, top_k)
        hits = count_hits(guesses, actual[score_rows])[0]
        if hits > best_hits:
            best_alpha, best_hits = alpha, hits
    weight, bias = fit_ridge(features, target - base, best_alpha)
    return Probe(weight, bias, best_alpha)


# ---------------------------------------------------------------------------------------------
# Running the model


def record(engine, prompts: list[list[int]], generate: int, progress: bool = True) -> Recording:
    """Greedy runs of ``prompts`` on ``engine`` with the routing capture keeping hidden states."""
    capture = engine.model.routing_capture
    eos = engine.tokenizer.eos_token_ids
    parts: dict[str, list[np.ndarray]] = {"experts": [], "moe_inputs": [], "residuals": [], "sequence": [], "decode": []}
    started = time.monotonic()

    def step(session, seq: int, ids: list[int], decode: bool) -> int:
        logits = session.forward(ids, all_logits=False)  # (1, V)
        routing = capture.step()
        if routing is None or routing.moe_inputs is None or routing.residuals is None:
            raise RuntimeError("the routing capture missed a MoE layer of the step")
        for name, array in (("experts", routing.experts), ("moe_inputs", routing.moe_inputs),
                            ("residuals", routing.residuals)):
            parts[name].append(array)
        parts["sequence"].append(np.full(len(ids), seq, np.int64))
        parts["decode"].append(np.full(len(ids), decode))
        return int(np.argmax(logits[-1]))

    capture.enabled = capture.keep_hidden = True
    try:
        for seq, prompt in enumerate(prompts):
            session = engine.new_session(max_context=len(prompt) + generate + 1)
            token = step(session, seq, prompt, decode=False)
            for _ in range(generate):
                if token in eos:
                    break
                token = step(session, seq, [token], decode=True)
            if progress:
                print(f"window {seq + 1}/{len(prompts)} ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    finally:
        capture.enabled = capture.keep_hidden = False
    return Recording(np.concatenate(parts["experts"], axis=1).astype(np.int64),
                     np.concatenate(parts["moe_inputs"], axis=1), np.concatenate(parts["residuals"], axis=1),
                     np.concatenate(parts["sequence"]), np.concatenate(parts["decode"]))


class NextLayer:
    """What a predictor needs of MoE layer l+1: its router (ranking any number of experts), its
    router logits, and its pre-MoE input transform."""

    def __init__(self, model, layer: int, most_guesses: int) -> None:
        from colibrid.engine.forward.moe import Router

        self.layer = model.layers[layer]
        block = self.layer.moe
        self.config = c = model.config
        self.ranker = Router(c, block.w, top_k=most_guesses)  # the C router, more experts ranked
        self.router_weight = block.w["router"]  # (E, D)
        self.router_bias = block.w["router_bias"].data if "router_bias" in block.w else None  # (E)
        # The probe ranks by logits: right where the router chooses by them (no choice bias, groups, own norm)
        self.logits_rank_choice = ("router_choice_bias" not in block.w and c.router_groups == 1 and "router_norm" not in block.w
                                   and c.router_scoring in ("softmax", "topk_softmax", "sigmoid"))

    def moe_input_of(self, residual: np.ndarray) -> np.ndarray:
        """(N, D) what this layer's router would read if its attention added nothing to ``residual``
        (the engine's router-on-residual lookahead reads the same)."""
        return self.layer.router_input_of(residual)

    def ranking(self, x: np.ndarray) -> np.ndarray:
        """(N, most_guesses) this layer's router's best experts for rows x (N, D), best first."""
        return self.ranker(np.ascontiguousarray(x, dtype=np.float32)).experts.astype(np.int64)

    def logits(self, x: np.ndarray) -> np.ndarray:
        """(N, E) this layer's router logits for rows x (N, D)."""
        from colibrid.engine.forward.ops import linear

        out = linear(np.ascontiguousarray(x, dtype=np.float32), self.router_weight).astype(np.float64)
        return out if self.router_bias is None else out + self.router_bias


@dataclass
class Study:
    """Every predictor's guesses for every layer pair (l, l+1), over all rows."""

    top_k: int
    budgets: list[int]
    moe_layers: list[int]
    guesses: dict[str, list[np.ndarray]]  # predictor -> per pair (N, M) guesses, best first, -1 none
    previous: list[np.ndarray]  # per pair (N, top_k) the previous token's experts at l+1
    actual: list[np.ndarray]  # per pair (N, A) layer l+1's experts
    probes: dict[str, list[Probe]]  # "probe" and "probe-context": per pair, when they ran
    fit: np.ndarray  # (N,) bool rows the probe fit on
    scored: np.ndarray  # (N,) bool rows every predictor is scored on


def predict(model, rec: Recording, top_k: int, guess_budgets: list[int]) -> Study:
    """Runs every predictor over ``rec``: rankings of max(budgets) guesses per row and pair."""
    moe_layers = [block.layer for block in (layer.moe for layer in model.layers) if block is not None]
    most = max(guess_budgets)
    fit, scored = rec.fit_rows(), rec.eval_rows()
    guesses: dict[str, list[np.ndarray]] = {name: [] for name in MODEL_BASED + ("previous-token",)}
    previous, actual = [], []
    probes: dict[str, list[Probe]] = {"probe": [], "probe-context": []}
    for pair in range(len(moe_layers) - 1):
        nxt = NextLayer(model, moe_layers[pair + 1], most)
        features = nxt.moe_input_of(rec.residuals[pair])  # (N, D) float32
        guesses["router-on-moe-input"].append(nxt.ranking(rec.moe_inputs[pair]))
        guesses["router-on-residual"].append(nxt.ranking(features))
        truth = rec.experts[pair + 1]
        if nxt.logits_rank_choice and rec.windows >= 4:
            base, target = nxt.logits(features), nxt.logits(rec.moe_inputs[pair + 1])
            context = np.concatenate([features, previous_rows(rec.moe_inputs[pair + 1], rec.sequence)], axis=1)
            for name, inputs in (("probe", features), ("probe-context", context)):
                probe = fit_probe(inputs[fit], base[fit], target[fit], truth[fit], rec.sequence[fit], rec.decode[fit],
                                  top_k)
                probes[name].append(probe)
                guesses[name].append(rank(probe.logits(inputs, base), most))
        recent = recent_experts(truth, rec.sequence, max(most, top_k))
        guesses["previous-token"].append(recent[:, :most])
        previous.append(recent[:, :top_k])
        actual.append(truth)
    if not probes["probe"]:  # too few windows, or a router the logits do not rank (said in the report)
        del guesses["probe"], guesses["probe-context"]
        probes = {}
    return Study(top_k, guess_budgets, moe_layers, guesses, previous, actual, probes, fit, scored)


def union_partner(study: Study) -> str:
    """The predictor joined with the previous token's experts: the probe with context, which can
    only learn on top of router-on-residual, or router-on-residual where there is no probe."""
    return "probe-context" if "probe-context" in study.guesses else "router-on-residual"


def scores(study: Study, per_layer: bool = False) -> list[dict]:
    """One row per predictor and n: recall, precision, over-fetch on the eval rows, the mean of
    the layer pairs' (and each pair's, with ``per_layer``)."""
    rows_out = []
    best = union_partner(study)
    names = list(study.guesses) + [f"{best}+previous-token"]
    for name in names:
        for n in study.budgets:
            layers = []
            for pair, truth in enumerate(study.actual):
                if name.endswith("+previous-token"):
                    g = join_guesses(study.guesses[best][pair][:, :n], study.previous[pair])
                else:
                    g = study.guesses[name][pair][:, :n]
                hits, guessed, used = count_hits(g[study.scored], truth[study.scored])
                layers.append({"layer": study.moe_layers[pair + 1], "hits": hits, "guessed": guessed, "actual": used,
                               "recall": hits / max(used, 1), "precision": hits / max(guessed, 1),
                               "overfetch": guessed / max(used, 1)})
            row = {"predictor": name, "n": n, **{key: float(np.mean([item[key] for item in layers]))
                                                  for key in ("recall", "precision", "overfetch")}}
            if per_layer:
                row["layers"] = layers
            rows_out.append(row)
    return rows_out


def print_table(rows: list[dict], per_layer: bool) -> None:
    print(f"{'predictor':>34} {'n':>3} {'over-fetch':>10} {'recall':>7} {'precision':>9}")
    for row in rows:
        print(f"{row['predictor']:>34} {row['n']:>3} {row['overfetch']:>9.2f}x {row['recall']:>7.1%} "
              f"{row['precision']:>9.1%}")
        if per_layer:
            for item in row["layers"]:
                print(f"{'layer ' + str(item['layer']):>34} {'':>3} {item['overfetch']:>9.2f}x {item['recall']:>7.1%} "
                      f"{item['precision']:>9.1%}")


def markdown_table(rows: list[dict], top_k: int) -> str:
    """The rows as a Markdown table: a predictor per line, a guess count per column, each cell
    "recall / precision" (and the over-fetch where it is not n / top-k)."""
    ns = sorted({row["n"] for row in rows})
    names = list(dict.fromkeys(row["predictor"] for row in rows))
    cells = {(row["predictor"], row["n"]): row for row in rows}
    lines = ["| predictor | " + " | ".join(f"n = {n} ({round(n / top_k, 3):g}×)" for n in ns) + " |",
             "|---" * (len(ns) + 1) + "|"]
    for name in names:
        out = []
        for n in ns:
            row = cells[name, n]
            cell = f"{row['recall']:.1%} / {row['precision']:.1%}"
            if abs(row["overfetch"] - n / top_k) > 0.005:
                cell += f" ({row['overfetch']:.2f}×)"
            out.append(cell)
        lines.append(f"| {name} | " + " | ".join(out) + " |")
    return "\n".join(lines)


def run(pack_path: Path, sequences: int, prompt_tokens: int, generate: int, factors=BUDGET_FACTORS,
        progress: bool = True) -> tuple[Study, dict]:
    from colibrid.engine.engine import Engine
    from colibrid.pack.reader import Pack

    pack = Pack.open(pack_path)
    engine = Engine(pack)  # routed experts read with pread: routing does not depend on a cache
    try:
        config = engine.config
        prompts = validation_windows(engine.tokenizer, sequences, prompt_tokens)
        rec = record(engine, prompts, generate, progress)
        study = predict(engine.model, rec, config.num_experts_per_tok, budgets(config.num_experts_per_tok, factors, config.num_experts))
        info = {"model": pack.manifest.source.get("path", str(pack_path)), "num_experts": config.num_experts,
                "top_k": config.num_experts_per_tok, "moe_layers": study.moe_layers, "windows": rec.windows,
                "fit_rows": int(study.fit.sum()), "eval_decode_tokens": int(study.scored.sum()),
                "probe_ridge_alphas": {name: [p.alpha for p in fitted] for name, fitted in study.probes.items()},
                "made_by": f"bench/predictor_study.py --sequences {sequences} --prompt-tokens {prompt_tokens} "
                           f"--generate {generate}",
                "scored": "decode tokens of the second half of the windows"}
        return study, info
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help=f"checkpoint (default {DEFAULT_MODEL})")
    parser.add_argument("--pack", type=Path, default=None, help=f"its pack (default {PACK_DIR}/<model name>.pack)")
    parser.add_argument("--sequences", type=int, default=16, help="windows of the validation text (default 16)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    parser.add_argument("--generate", type=int, default=192, help="greedy tokens per window at most (default 192)")
    parser.add_argument("--factors", default=",".join(f"{f:g}" for f in BUDGET_FACTORS),
                        help="guesses per token as multiples of top-k, comma-separated (default %(default)s; the "
                             "engine's lookahead reads 4 of top-8 today: 0.5)")
    parser.add_argument("--per-layer", action="store_true", help="also each predicted layer's numbers")
    parser.add_argument("--markdown", action="store_true", help="also the table in Markdown (recall / precision)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if min(args.sequences, args.prompt_tokens, args.generate) < 1:
        raise SystemExit("--sequences, --prompt-tokens and --generate must be at least 1")
    try:
        factors = [float(f) for f in args.factors.split(",")]
    except ValueError:
        raise SystemExit(f"--factors must be numbers separated by commas, got {args.factors!r}") from None
    if not all(0 < f <= 16 for f in factors):
        raise SystemExit("--factors must be in (0, 16]")
    pack = ensure_pack(args.model, args.pack or PACK_DIR / f"{args.model.resolve().name}.pack")
    study, info = run(pack, args.sequences, args.prompt_tokens, args.generate, factors)
    rows = scores(study, args.per_layer)
    print(f"{info['model']}: {len(study.moe_layers)} MoE layers x {info['num_experts']} experts, top-{study.top_k}; "
          f"{info['windows']} windows, scored on {info['eval_decode_tokens']} decode tokens of the second half"
          + (f"; probe fit on {info['fit_rows']} rows of the first half, ridge alphas {info['probe_ridge_alphas']}"
             if study.probes else "; no probe (fewer than 4 windows, or a router its logits do not rank)"))
    print_table(rows, args.per_layer)
    if args.markdown:
        print("\n" + markdown_table(rows, study.top_k))
    if args.json:
        args.json.write_text(json.dumps({**info, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
