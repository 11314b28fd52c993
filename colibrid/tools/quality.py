"""The numbers of a quality measurement, as llama.cpp's llama-perplexity computes them, so ours
compare with its: how a text is cut into windows, which tokens of a window are scored, and the
statistics over the scored tokens (perplexity; against a base model, KL divergence, top-1
agreement, the perplexity difference). Pure numpy: colibrid/tools/perplexity.py runs the models.

Legend: W windows, N tokens per window (the context), S scored tokens per window, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

KL_PERCENTILE = 99.0  # the tail a quantization's worst tokens show in


def windows(token_ids: np.ndarray, context: int, bos_id: int | None = None,
            max_windows: int | None = None) -> np.ndarray:
    """(W, N) the text's windows: consecutive, non-overlapping slices of ``context`` tokens from
    the start, the remainder shorter than a window dropped (llama-perplexity's chunks). When the
    vocabulary adds a BOS, each window's first token is replaced by it, as llama-perplexity does:
    every window is then a document of its own. ValueError if not one window fits."""
    token_ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    if context < 4:
        raise ValueError(f"the context must be at least 4 tokens, not {context}")
    count = token_ids.shape[0] // context
    if count == 0:
        raise ValueError(f"the text is {token_ids.shape[0]} tokens, shorter than one window of {context}")
    if max_windows is not None:
        count = min(count, max_windows)
    result = token_ids[:count * context].reshape(count, context).copy()
    if bos_id is not None:
        result[:, 0] = bos_id
    return result


def scored_positions(context: int) -> tuple[slice, slice]:
    """(rows of a window's logits that are scored, the tokens they predict): the logits at
    positions N/2 .. N-2 predict tokens N/2+1 .. N-1, so every scored token has at least half a
    window of context, and S = N - N/2 - 1 (255 of a 512-token window, as llama-perplexity)."""
    first = context // 2
    return slice(first, context - 1), slice(first + 1, context)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """(S, V) float64 log-probabilities of (S, V) logits."""
    logits = np.asarray(logits, dtype=np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


@dataclass
class WindowScores:
    """What one window's scored tokens give (each (S,))."""

    nll: np.ndarray  # negative log-likelihood of the token that came
    top1: np.ndarray  # the model's most likely token
    kl: np.ndarray | None = None  # KL(base || this model), when there is a base


def score_window(logits: np.ndarray, targets: np.ndarray, base_log_probs: np.ndarray | None = None
                 ) -> tuple[WindowScores, np.ndarray]:
    """Scores of one window's scored rows: ``logits`` (S, V) and the tokens they predict,
    ``targets`` (S,) (scored_positions says which); with ``base_log_probs`` (S, V), the base
    model's log-probabilities of the same rows, the KL divergence per token. Returns the scores
    and this model's (S, V) log-probabilities (a base's are handed to its candidate)."""
    log_probs = log_softmax(logits)  # (S, V)
    picked = np.take_along_axis(log_probs, np.asarray(targets, dtype=np.int64)[:, None], axis=1)[:, 0]
    kl = None
    if base_log_probs is not None:
        kl = (np.exp(base_log_probs) * (base_log_probs - log_probs)).sum(axis=1)
        kl = np.maximum(kl, 0.0)  # rounding can leave -1e-17 where both agree
    return WindowScores(-picked, log_probs.argmax(axis=1), kl), log_probs


@dataclass
class Totals:
    """The scores of every window so far, and the statistics over them."""

    nll: list[np.ndarray] = field(default_factory=list)
    base_nll: list[np.ndarray] = field(default_factory=list)
    kl: list[np.ndarray] = field(default_factory=list)
    same_top1: list[np.ndarray] = field(default_factory=list)

    def add(self, scores: WindowScores, base: WindowScores | None = None) -> None:
        self.nll.append(scores.nll)
        if base is not None:
            self.base_nll.append(base.nll)
            self.kl.append(scores.kl)
            self.same_top1.append(scores.top1 == base.top1)

    @property
    def tokens(self) -> int:
        return sum(part.shape[0] for part in self.nll)

    def summary(self) -> dict:
        """perplexity (and its standard error, as llama-perplexity's "+/-"), mean NLL; with a base:
        the base's perplexity, dPPL (ours minus the base's), the ratio, mean KL, its 99th
        percentile and maximum, and top-1 agreement (the share of tokens where both models'
        most likely token is the same)."""
        nll = np.concatenate(self.nll)
        result = {"scored_tokens": int(nll.shape[0]), **_perplexity(nll)}
        if self.base_nll:
            base = _perplexity(np.concatenate(self.base_nll))
            kl = np.concatenate(self.kl)
            result.update({
                "base_perplexity": base["perplexity"],
                "base_perplexity_error": base["perplexity_error"],
                "dppl": result["perplexity"] - base["perplexity"],
                "ppl_ratio": result["perplexity"] / base["perplexity"],
                "kl_mean": float(kl.mean()),
                f"kl_p{KL_PERCENTILE:g}": float(np.percentile(kl, KL_PERCENTILE)),
                "kl_max": float(kl.max()),
                "top1_agreement": float(np.concatenate(self.same_top1).mean()),
            })
        return result


def _perplexity(nll: np.ndarray) -> dict:
    mean = float(nll.mean())
    perplexity = math.exp(mean)
    # the standard error of the mean NLL, carried to the perplexity (d exp(x) = exp(x) dx)
    error = float(nll.std(ddof=1) / math.sqrt(nll.shape[0])) * perplexity if nll.shape[0] > 1 else 0.0
    return {"perplexity": perplexity, "perplexity_error": error, "mean_nll": mean}
