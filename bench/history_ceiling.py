"""How well can an expert cache guess the next token's experts from routing history alone?

    python bench/history_ceiling.py bench/traces/stdlib64-greedy.jsonl

An online eviction policy only knows what was requested so far. This tool asks the question
behind every such policy directly: from each (layer, expert)'s own history up to token t, rank
a layer's experts for token t+1 and count how many of t+1's actual experts the best n hold
(recall at n, over the decode tokens of a routing_traces.py trace). Rankers:
  ema:H        the request count decayed with half-life H tokens (lfu-decay's score)
  linear       a least-squares fit, on the first half of the tokens, of "used at t+1" on every
               history feature at once (decayed counts at half-lives 1-128, tokens since the
               last use, whether t used it, the layer), scored on the second half
If the fitted ranker is no better than a single decayed count, no policy that reads only the
history can do much better than lfu-decay: the rest of the gap to Belady is the future.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cache_sim import read_trace  # noqa: E402

HALF_LIVES = (1, 2, 4, 8, 16, 32, 128)


def decode_usage(trace) -> np.ndarray:
    """(T, L, E) bool: which experts each decode token used (prompt steps dropped)."""
    decode = [step for step in trace.steps if step and len(step[0]) == 1]
    used = np.zeros((len(decode), len(trace.moe_layers), trace.num_experts), dtype=bool)
    for t, step in enumerate(decode):
        for layer, rows in enumerate(step):
            used[t, layer, rows[0]] = True
    return used


def history_features(used: np.ndarray) -> np.ndarray:
    """(T, L, E, F): per token t, what the history up to and including t says of each expert."""
    T, L, E = used.shape
    feats = np.zeros((T, L, E, len(HALF_LIVES) + 2 + L), dtype=np.float32)
    ema = np.zeros((len(HALF_LIVES), L, E))
    decay = 2.0 ** (-1.0 / np.array(HALF_LIVES))[:, None, None]
    since = np.full((L, E), 1000.0)
    layer_onehot = np.broadcast_to(np.eye(L)[:, None, :], (L, E, L))
    for t in range(T):
        ema = ema * decay + used[t] * (1 - decay)
        since = np.where(used[t], 0.0, since + 1)
        feats[t, ..., : len(HALF_LIVES)] = np.moveaxis(ema, 0, -1)
        feats[t, ..., len(HALF_LIVES)] = np.log1p(since)
        feats[t, ..., len(HALF_LIVES) + 1] = used[t]
        feats[t, ..., len(HALF_LIVES) + 2:] = layer_onehot
    return feats


def recall_at(scores: np.ndarray, actual: np.ndarray, n: int) -> float:
    """scores, actual: (T, L, E); the share of actual experts among each (t, layer)'s best n."""
    best = np.argsort(-scores, axis=-1, kind="stable")[..., :n]
    return float(np.take_along_axis(actual, best, axis=-1).sum() / actual.sum())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--budgets", default="1,1.5,2,4", help="n as multiples of top-k (default 1,1.5,2,4)")
    args = parser.parse_args(argv)
    trace = read_trace(args.trace)
    used = decode_usage(trace)
    top_k = int(used[0, 0].sum())
    feats, target = history_features(used)[:-1], used[1:]
    half = len(target) // 2
    x = np.concatenate([feats.reshape(-1, feats.shape[-1]), np.ones((feats[..., :1].size, 1), np.float32)], axis=1)
    rows = half * used.shape[1] * used.shape[2]
    weights, *_ = np.linalg.lstsq(x[:rows], target.reshape(-1)[:rows].astype(np.float32), rcond=None)
    fitted = (x[rows:] @ weights).reshape(target[half:].shape)
    rankers = {f"ema:{h}": feats[half:, ..., i] for i, h in enumerate(HALF_LIVES)} | {"linear": fitted}
    budgets = [max(1, round(float(b) * top_k)) for b in args.budgets.split(",")]
    print(f"{args.trace}: {len(used)} decode tokens, {used.shape[1]} layers x {used.shape[2]} experts, top-{top_k}; "
          f"scored on the last {len(target) - half} (the linear ranker is fitted on the first {half})")
    print(f"{'ranker':>10} " + " ".join(f"{'recall@' + str(n):>10}" for n in budgets))
    for name, scores in rankers.items():
        print(f"{name:>10} " + " ".join(f"{recall_at(scores, target[half:], n):10.1%}" for n in budgets))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
