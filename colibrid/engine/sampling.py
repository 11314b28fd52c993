"""Choosing the next token from the model's logits, and watching the text for stop strings.

The processing follows transformers' generate() so that a request means the same thing here
as there: repetition penalty (a logits processor, applied even when greedy), then - only when
sampling - temperature, top-k, top-p and min-p, in that order, then one draw from the
softmax of what is left.

Everything is vectorised over the vocabulary with numpy (V up to ~256k); the only Python loops
are over stop strings and their lengths.

Legend: V vocabulary size, K candidate tokens still in play.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from colibrid import native

# SamplingParams is shared with the wire protocol, so it lives outside the engine; re-exported
# here, next to the sampler that reads it.
from colibrid.wire.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Top-p first looks for its nucleus among this many best tokens (one partial sort), then among
# 16 times as many, and sorts the whole vocabulary only when their mass still falls short of top_p.
TOP_P_FIRST_CANDIDATES = 1024


# generation_config.json keys that set a sampling default, and SamplingParams' name for each.
_GENERATION_CONFIG_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                               "repetition_penalty": "repetition_penalty"}


def model_sampling_defaults(generation_config: dict) -> dict:
    """The sampling settings a checkpoint's generation_config.json asks for, as SamplingParams
    fields: what a request that names none of them gets.

    Follows transformers where the file is explicit: ``do_sample: true`` makes its
    temperature/top_p/top_k/min_p the defaults, ``do_sample: false`` makes the default greedy,
    and repetition_penalty applies either way. A file that says nothing about sampling (most
    only list token ids) leaves Colibri's own defaults — not transformers' greedy, which would
    silently change what every such model answers. Out-of-range values are ignored with a warning.
    """
    defaults = {}
    do_sample = generation_config.get("do_sample")
    if do_sample is False:
        defaults["temperature"] = 0.0
    keys = _GENERATION_CONFIG_SAMPLING if do_sample is True else {"repetition_penalty": "repetition_penalty"}
    for key, field_name in keys.items():
        value = generation_config.get(key)
        if value is None:
            continue
        try:
            SamplingParams(**{field_name: value})  # raises for a value out of range
        except (TypeError, ValueError) as exc:
            logger.warning("generation_config.json: ignoring %s: %s", key, exc)
            continue
        defaults[field_name] = value
    return defaults


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float  # log-softmax of the raw model logits at token_id
    top_logprobs: list[tuple[int, float]] | None  # (id, logprob), most likely first; None if not asked


# --------------------------------------------------------------------------------------------
# The processing steps, each a plain function of arrays so tests can hold them against a
# straightforward reference.
# --------------------------------------------------------------------------------------------


def apply_repetition_penalty(scores: np.ndarray, previous_ids: np.ndarray, penalty: float) -> np.ndarray:
    """CTRL's penalty on every id seen before (prompt included): positive scores / penalty, others * penalty.

    scores (V,) is changed in place and returned. Each id is penalised once however often it
    occurred: duplicate ids gather the same original score and scatter the same result.
    Ids outside the vocabulary are ignored, as transformers ignores them.
    """
    ids = previous_ids[(previous_ids >= 0) & (previous_ids < scores.shape[0])]
    seen = scores[ids]
    scores[ids] = np.where(seen < 0, seen * penalty, seen / penalty)
    return scores


def top_k_keeps_all(top_k: int, vocab_size: int) -> bool:
    """Whether top-k leaves every token in play (0 and anything at or over the vocabulary do)."""
    return top_k <= 0 or top_k >= vocab_size


def top_k_candidates(scores: np.ndarray, top_k: int) -> np.ndarray:
    """Ids whose score is at least the k-th best (ties at the edge kept, as transformers keeps them)."""
    vocab_size = scores.shape[0]
    if top_k_keeps_all(top_k, vocab_size):
        return np.arange(vocab_size)
    kth_best = np.partition(scores, vocab_size - top_k)[vocab_size - top_k]
    return np.flatnonzero(scores >= kth_best)


def _softmax(scores: np.ndarray) -> np.ndarray:
    shifted = np.exp(scores - scores.max())
    return shifted / shifted.sum()


def _order_by_score(ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """Positions of `ids` sorted by score descending, equal scores by lower id first."""
    by_id = np.argsort(ids, kind="stable")
    return by_id[np.argsort(-scores[by_id], kind="stable")]


def top_p_keep(scores: np.ndarray, top_p: float) -> np.ndarray:
    """Positions (into `scores`, (K,)) of the nucleus: the best tokens whose mass reaches top_p.

    transformers removes a token when the probability mass of the tokens ranked above it is
    already >= top_p; the best token always stays. Sorting 150k scores costs milliseconds, so
    the nucleus is first looked for among the best TOP_P_FIRST_CANDIDATES (then 16x as many),
    which is enough whenever their mass reaches top_p: every token outside them has at least
    that much mass above it.
    """
    probs = _softmax(scores)
    for n_candidates in (TOP_P_FIRST_CANDIDATES, 16 * TOP_P_FIRST_CANDIDATES):
        if probs.shape[0] <= n_candidates:
            break
        best = np.argpartition(-probs, n_candidates - 1)[:n_candidates]
        if probs[best].sum() >= top_p:
            return _nucleus(best, probs, top_p)
    return _nucleus(np.arange(probs.shape[0]), probs, top_p)


def _nucleus(positions: np.ndarray, probs: np.ndarray, top_p: float) -> np.ndarray:
    """The leading part of `positions`, by probability, whose mass above each member is < top_p."""
    # Default (unstable) sort: several times faster than a stable one at this size, and still
    # deterministic, so seeded runs repeat; only the order among exactly equal probabilities is arbitrary.
    ordered = positions[np.argsort(-probs[positions])]
    mass_above = np.cumsum(probs[ordered]) - probs[ordered]
    keep = mass_above < top_p
    keep[0] = True
    return ordered[keep]


def min_p_keep(scores: np.ndarray, min_p: float) -> np.ndarray:
    """Positions (into `scores`, (K,)) whose probability is >= min_p times the best probability."""
    probs = _softmax(scores)
    keep = probs >= min_p * probs.max()
    return np.flatnonzero(keep)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """(V,) float64 log-probabilities."""
    scores = logits.astype(np.float64)
    top = scores.max()
    return scores - (top + np.log(np.exp(scores - top).sum()))


def top_logprobs(logprobs: np.ndarray, n: int) -> list[tuple[int, float]]:
    """The n most likely (id, logprob), most likely first, equal logprobs by lower id first."""
    n = min(n, logprobs.shape[0])
    if n <= 0:
        return []
    best = np.argpartition(-logprobs, n - 1)[:n]
    best = best[_order_by_score(best, logprobs[best])]
    return [(int(i), float(logprobs[i])) for i in best]


def penalized_scores(
    logits: np.ndarray, previous_ids: Sequence[int] | np.ndarray, repetition_penalty: float
) -> np.ndarray:
    """(V,) float64 scores after the repetition penalty - what greedy decoding takes the argmax of.

    transformers applies the penalty as a logits processor, so it changes greedy choices too.
    """
    scores = logits.astype(np.float64)  # a copy: the penalty writes in place
    if repetition_penalty != 1.0 and len(previous_ids) > 0:
        apply_repetition_penalty(scores, np.asarray(previous_ids, dtype=np.int64), repetition_penalty)
    return scores


def sampling_candidates(scores: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The tokens sampling may pick from (K,) and their scores (K,), softmax of which is the distribution.

    `scores` (V,) are penalized_scores(); then temperature, top-k, top-p, min-p, in
    transformers' order. Each step only removes tokens, so later steps work on fewer.
    """
    if params.temperature != 1.0:
        scores = scores / params.temperature
    vocab_size = scores.shape[0]
    # None: every id is still in play, in id order (no (V,) index array and copy of the scores
    # when top-k keeps everything, as it does by default).
    candidate_ids = None if top_k_keeps_all(params.top_k, vocab_size) else top_k_candidates(scores, params.top_k)
    candidate_scores = scores if candidate_ids is None else scores[candidate_ids]
    for keep, value, applies in ((top_p_keep, params.top_p, params.top_p < 1.0),
                                 (min_p_keep, params.min_p, params.min_p > 0.0)):
        if applies:
            kept = keep(candidate_scores, value)  # positions into the candidates
            candidate_ids = kept if candidate_ids is None else candidate_ids[kept]
            candidate_scores = candidate_scores[kept]
    return (np.arange(vocab_size) if candidate_ids is None else candidate_ids), candidate_scores


class Sampler:
    """Picks tokens for one request; owns the request's random generator.

    With a seed, the same sequence of (logits, previous ids) always yields the same tokens.
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)
        # Two (V,) float64 work buffers kept from step to step: a fresh 400 kB array is a fresh
        # mapping whose page faults cost more than the arithmetic done in it.
        self._work: tuple[np.ndarray, np.ndarray] | None = None

    def sample(self, logits: np.ndarray, previous_ids: Sequence[int] | np.ndarray) -> SampledToken:
        """Choose the next token from `logits` (V,) given every id so far (prompt and output).

        The reported logprob (and top_logprobs) is the log-softmax of the raw model logits,
        before repetition penalty, temperature and truncation: it describes the model, not the
        sampling settings, so it is comparable across requests and with transformers'
        output_logits. (Sampling-adjusted logprobs would be -inf for truncated alternatives.)
        """
        logits = np.asarray(logits)
        if logits.ndim != 1:
            raise ValueError(f"logits must be one row (V,), got shape {logits.shape}")
        raw, raw_exp = self._work_buffers(logits.shape[0])  # (V,) each
        np.copyto(raw, logits)
        top = raw.max()
        if not np.isfinite(top):
            # The max is NaN if any logit is, +inf if any is, -inf if all are: the forward pass
            # is broken, and sampling from it would hide that.
            raise ValueError("logits contain NaN or +inf, or are all -inf")
        # The softmax numerators of the raw logits give every logprob (log_softmax, with the
        # same operations); when a request draws from the raw logits unchanged they are its
        # distribution too, so a step exponentiates the vocabulary once, not twice.
        np.exp(np.subtract(raw, top, out=raw_exp), out=raw_exp)
        log_total = top + np.log(raw_exp.sum())
        token_id = self._choose(raw, raw_exp, previous_ids)
        alternatives = None if self.params.logprobs is None else top_logprobs(raw - log_total, self.params.logprobs)
        return SampledToken(token_id=token_id, logprob=float(raw[token_id] - log_total), top_logprobs=alternatives)

    def _choose(self, raw: np.ndarray, raw_exp: np.ndarray, previous_ids: Sequence[int] | np.ndarray) -> int:
        params = self.params
        penalized = params.repetition_penalty != 1.0 and len(previous_ids) > 0
        scores = penalized_scores(raw, previous_ids, params.repetition_penalty) if penalized else raw
        if params.is_greedy:
            # np.argmax returns the first maximum, i.e. the lowest id on ties, like torch.argmax.
            return int(np.argmax(scores))
        if not penalized and params.temperature == 1.0 and _keeps_every_token(params, raw.shape[0]):
            return self._draw_from(raw_exp)  # the distribution is the raw softmax itself
        candidate_ids, candidate_scores = sampling_candidates(scores, params)
        return int(candidate_ids[self._draw_from(np.exp(candidate_scores - candidate_scores.max()))])

    def _work_buffers(self, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
        if self._work is None or self._work[0].shape[0] != vocab_size:
            self._work = (np.empty(vocab_size, np.float64), np.empty(vocab_size, np.float64))
        return self._work

    def _draw_from(self, numerators: np.ndarray) -> int:
        """One position drawn from the distribution numerators / their sum (K,), by inverting
        the cumulative distribution (normalised as _softmax does, so the same bits either way;
        libcolibri sums it as np.cumsum would, and searches it, four times faster).
        ``numerators`` is overwritten: it becomes the cumulative distribution."""
        probabilities = np.divide(numerators, numerators.sum(), out=numerators)
        position = native.draw_cumulative(probabilities, self._rng.random())
        return min(position, numerators.shape[0] - 1)


def _keeps_every_token(params: SamplingParams, vocab_size: int) -> bool:
    """Whether top-k, top-p and min-p all leave the whole vocabulary in play."""
    return top_k_keeps_all(params.top_k, vocab_size) and params.top_p >= 1.0 and params.min_p <= 0.0


# --------------------------------------------------------------------------------------------
# Stop strings
# --------------------------------------------------------------------------------------------


class StopMatcher:
    """Watches streamed text for stop strings.

    `push(delta)` returns the text that is safe to emit now and whether a stop string has
    appeared. Text that could be the start of a stop string is held back until the next
    deltas decide it; on a match, the emitted text ends right before the stop string, and
    everything after is dropped. When several stop strings complete in the same delta, the
    one that completes first wins (as if the text had arrived one character at a time).
    """

    def __init__(self, stop_strings: Sequence[str]) -> None:
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(dict.fromkeys(stop_strings))
        self._max_held_chars = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""
        self.matched: str | None = None  # the stop string that matched, once one has

    def push(self, delta: str) -> tuple[str, bool]:
        if self.matched is not None:
            return "", True
        text = self._held + delta
        match = self._first_match(text)
        if match is not None:
            start, stop = match
            self.matched = stop
            self._held = ""
            return text[:start], True
        held_chars = self._longest_stop_prefix_suffix(text)
        self._held = text[len(text) - held_chars :]
        return text[: len(text) - held_chars], False

    def flush(self) -> str:
        """The held-back text, once no more text will come."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop in self._stops:
            start = text.find(stop)
            if start < 0:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        return None if best is None else (best[1], best[2])

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest end of `text` that some stop string starts with."""
        for length in range(min(len(text), self._max_held_chars), 0, -1):
            tail = text[len(text) - length :]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0
