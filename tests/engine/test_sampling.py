"""Sampling: the logits processing matches transformers (and a plain reference), draws are
reproducible and follow the distribution; StopMatcher holds back and cuts at stop strings."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from colibrid.wire.sampling_params import GREEDY_TEMPERATURE_BELOW, MAX_TOP_LOGPROBS, SamplingParams
from colibrid.engine.sampling import (
    TOP_P_FIRST_CANDIDATES,
    Sampler,
    StopMatcher,
    apply_repetition_penalty,
    log_softmax,
    penalized_scores,
    sampling_candidates,
)


def _logits(vocab_size: int, seed: int, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(vocab_size) * scale).astype(np.float32)


# ---- plain references: one obvious line of numpy (or Python) per rule ----------------------------


def reference_kept(logits: np.ndarray, previous_ids: list[int], params: SamplingParams) -> dict[int, float]:
    """{token id: probability} after every processing step, written the straightforward way."""
    scores = logits.astype(np.float64).copy()
    penalty = params.repetition_penalty
    for token_id in set(previous_ids):
        scores[token_id] = scores[token_id] * penalty if scores[token_id] < 0 else scores[token_id] / penalty
    scores = scores / params.temperature
    if params.top_k:
        kth = sorted(scores, reverse=True)[min(params.top_k, len(scores)) - 1]
        scores[scores < kth] = -np.inf
    if params.top_p < 1.0:
        probs = np.exp(scores - scores.max())
        probs /= probs.sum()
        mass_above = 0.0
        for token_id in sorted(range(len(scores)), key=lambda i: (-probs[i], i)):
            if mass_above >= params.top_p:
                scores[token_id] = -np.inf
            mass_above += probs[token_id]
    if params.min_p > 0:
        probs = np.exp(scores - scores.max())
        scores[probs < params.min_p] = -np.inf
    probs = np.exp(scores - scores.max())
    probs /= probs.sum()
    return {int(i): float(probs[i]) for i in np.flatnonzero(probs > 0)}


def ours_kept(logits: np.ndarray, previous_ids: list[int], params: SamplingParams) -> dict[int, float]:
    ids, scores = sampling_candidates(penalized_scores(logits, previous_ids, params.repetition_penalty), params)
    probs = np.exp(scores - scores.max())
    probs /= probs.sum()
    return {int(i): float(p) for i, p in zip(ids, probs)}


def transformers_kept(logits: np.ndarray, previous_ids: list[int], params: SamplingParams) -> dict[int, float]:
    """transformers' own processors, in the order generate() builds them (float64 to avoid edge rounding)."""
    torch = pytest.importorskip("torch")
    lp = pytest.importorskip("transformers.generation.logits_process")
    processors = []
    if params.repetition_penalty != 1.0:
        processors.append(lp.RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.temperature != 1.0:
        processors.append(lp.TemperatureLogitsWarper(float(params.temperature)))
    if params.top_k:
        processors.append(lp.TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        processors.append(lp.TopPLogitsWarper(params.top_p))
    processors.append(lp.MinPLogitsWarper(params.min_p))  # generate() adds it whenever min_p is set
    input_ids = torch.tensor([[int(i) for i in previous_ids]], dtype=torch.long).reshape(1, len(previous_ids))
    scores = torch.tensor(logits.astype(np.float64))[None, :]
    for processor in processors:
        scores = processor(input_ids, scores)
    probs = torch.softmax(scores, dim=-1)[0].numpy()
    return {int(i): float(probs[i]) for i in np.flatnonzero(probs > 0)}


SETTINGS = [
    SamplingParams(),
    SamplingParams(temperature=0.7),
    SamplingParams(top_k=5),
    SamplingParams(top_k=40, temperature=1.3),
    SamplingParams(top_p=0.9),
    SamplingParams(top_p=0.5, temperature=0.6),
    SamplingParams(min_p=0.05),
    SamplingParams(min_p=0.2, temperature=1.5, top_k=50),
    SamplingParams(top_k=100, top_p=0.8, min_p=0.02, temperature=0.8, repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.7, top_p=0.95),
]


def _assert_same_distribution(got: dict[int, float], expected: dict[int, float]) -> None:
    assert set(got) == set(expected)
    for token_id, prob in expected.items():
        assert got[token_id] == pytest.approx(prob, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("params", SETTINGS, ids=repr)
@pytest.mark.parametrize("vocab_size", [64, 3000])
def test_candidates_match_reference_and_transformers(params, vocab_size):
    for seed in range(3):
        logits = _logits(vocab_size, seed)
        previous = list(np.random.default_rng(100 + seed).integers(0, vocab_size, 40))
        got = ours_kept(logits, previous, params)
        _assert_same_distribution(got, reference_kept(logits, previous, params))
        _assert_same_distribution(got, transformers_kept(logits, previous, params))


@pytest.mark.parametrize(
    ("scale", "min_kept", "max_kept"),
    [
        (4.0, 1, TOP_P_FIRST_CANDIDATES),
        (2.0, TOP_P_FIRST_CANDIDATES, 16 * TOP_P_FIRST_CANDIDATES),
        (0.2, 16 * TOP_P_FIRST_CANDIDATES, None),
    ],
    ids=["first-candidates", "16x-candidates", "full-sort"],
)
def test_top_p_on_a_large_vocabulary_takes_every_path(scale, min_kept, max_kept):
    vocab_size = 20 * TOP_P_FIRST_CANDIDATES
    logits = _logits(vocab_size, 7, scale=scale)
    params = SamplingParams(top_p=0.9)
    got = ours_kept(logits, [], params)
    assert min_kept <= len(got) <= (max_kept or vocab_size)
    _assert_same_distribution(got, reference_kept(logits, [], params))


def test_top_k_keeps_ties_at_the_edge():
    logits = np.array([1.0, 3.0, 2.0, 2.0, 0.5], dtype=np.float32)
    assert set(ours_kept(logits, [], SamplingParams(top_k=2))) == {1, 2, 3}


def test_repetition_penalty_divides_positive_and_multiplies_negative_once():
    scores = np.array([2.0, -2.0, 0.0, 4.0, -1.0])
    apply_repetition_penalty(scores, np.array([0, 1, 2, 1, 1, 99, -3]), 2.0)  # repeats and out-of-range ids
    np.testing.assert_array_equal(scores, [1.0, -4.0, 0.0, 4.0, -1.0])


# ---- greedy, seeds, the draw ---------------------------------------------------------------------


def test_greedy_takes_lowest_id_on_ties():
    logits = np.array([0.0, 5.0, 1.0, 5.0, 5.0], dtype=np.float32)
    sampler = Sampler(SamplingParams(temperature=0.0, seed=1))
    assert {sampler.sample(logits, []).token_id for _ in range(10)} == {1}


def test_greedy_applies_repetition_penalty_like_transformers():
    logits = np.array([3.0, 2.9, -1.0], dtype=np.float32)
    assert Sampler(SamplingParams(temperature=0.0)).sample(logits, [0]).token_id == 0
    assert Sampler(SamplingParams(temperature=0.0, repetition_penalty=1.2)).sample(logits, [0]).token_id == 1


def test_greedy_ignores_top_k_top_p_min_p_and_temperature():
    logits = _logits(500, 3)
    params = SamplingParams(temperature=0.0, top_k=3, top_p=0.1, min_p=0.9)
    assert Sampler(params).sample(logits, []).token_id == int(np.argmax(logits))


@pytest.mark.parametrize("temperature", [1e-310, 5e-324, 1e-300, GREEDY_TEMPERATURE_BELOW / 2],
                         ids=["denormal", "smallest-denormal", "tiny", "half-the-threshold"])
def test_a_temperature_below_the_threshold_is_greedy(temperature):
    # Dividing by a denormal made every score infinite and the draw garbage.
    for seed in range(20):
        logits = _logits(1000, seed, scale=30.0)
        sampler = Sampler(SamplingParams(temperature=temperature, seed=seed))
        assert sampler.sample(logits, []).token_id == int(np.argmax(logits))


def test_the_threshold_itself_samples():
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE_BELOW).is_greedy
    assert SamplingParams(temperature=0.0).is_greedy


def test_same_seed_same_tokens_different_seed_different_tokens():
    logits = np.zeros(1000, dtype=np.float32)  # uniform: every draw is the generator's choice

    def draws(seed):
        sampler = Sampler(SamplingParams(seed=seed))
        return [sampler.sample(logits, []).token_id for _ in range(30)]

    assert draws(42) == draws(42)
    assert draws(42) != draws(43)


def test_draws_follow_the_processed_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    sampler = Sampler(SamplingParams(top_k=3, seed=0))
    n_draws = 6000
    counts = np.bincount([sampler.sample(logits, []).token_id for _ in range(n_draws)], minlength=4)
    assert counts[3] == 0  # cut by top-k
    expected = np.array([0.5, 0.3, 0.15]) / 0.95 * n_draws
    chi_square = float((((counts[:3] - expected) ** 2) / expected).sum())
    assert chi_square < 13.8  # p = 0.001 for 2 degrees of freedom


@pytest.mark.parametrize("vocab_size", [1, 7, 50304])
def test_the_native_draw_is_numpy_s_cumsum_and_searchsorted_bit_for_bit(vocab_size):
    """libcolibri's col_draw_cumulative against what the sampler did in numpy before: the same
    running sums and the same position for every u, the edges included (u = 0 with leading
    zero probabilities, u just below 1, a target that rounds up to the total)."""
    from colibrid import native

    rng = np.random.default_rng(vocab_size)
    for trial in range(20):
        weights = np.exp(rng.standard_normal(vocab_size) * 4)
        weights[: min(trial % 3, vocab_size - 1)] = 0.0  # tokens whose exp underflowed
        probabilities = weights / weights.sum()
        for u in (0.0, rng.random(), 0.5, float(np.nextafter(1.0, 0.0)), 1.0):
            expected = np.cumsum(probabilities)
            got = probabilities.copy()
            position = native.draw_cumulative(got, u)
            assert np.array_equal(got, expected)
            assert position == int(np.searchsorted(expected, u * expected[-1], side="right"))
    with pytest.raises(native.InvalidArgumentError):
        native.draw_cumulative(np.ones(4, np.float32), 0.5)


def test_seeded_draws_are_those_of_the_numpy_draw():
    """The sampler's tokens with the native draw are the tokens numpy's cumsum and searchsorted
    gave: a seeded request answers as it did before the change."""
    logits = (np.random.default_rng(3).standard_normal(50304) * 3).astype(np.float32)
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11))
    reference_rng = np.random.default_rng(11)
    numerators = np.exp(logits.astype(np.float64) - logits.astype(np.float64).max())
    cumulative = np.cumsum(numerators / numerators.sum())
    for _ in range(200):
        expected = min(int(np.searchsorted(cumulative, reference_rng.random() * cumulative[-1], side="right")),
                       logits.shape[0] - 1)
        assert sampler.sample(logits, []).token_id == expected


# ---- logprobs --------------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_and_sum_to_one():
    vocab_size = MAX_TOP_LOGPROBS
    logits = _logits(vocab_size, 11)
    sampled = Sampler(SamplingParams(temperature=0.3, top_k=2, logprobs=vocab_size, seed=5)).sample(logits, [])
    ids = [token_id for token_id, _ in sampled.top_logprobs]
    values = [logprob for _, logprob in sampled.top_logprobs]
    assert sorted(ids) == list(range(vocab_size))
    assert values == sorted(values, reverse=True)
    assert math.fsum(math.exp(v) for v in values) == pytest.approx(1.0, abs=1e-9)
    raw = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum())
    assert sampled.logprob == pytest.approx(raw[sampled.token_id], abs=1e-6)  # not the tempered value
    assert dict(sampled.top_logprobs)[sampled.token_id] == sampled.logprob


def test_top_logprobs_count_order_and_ties():
    logits = np.array([1.0, 3.0, 3.0, 2.0, -1.0], dtype=np.float32)
    sampled = Sampler(SamplingParams(logprobs=3, seed=0)).sample(logits, [])
    assert [token_id for token_id, _ in sampled.top_logprobs] == [1, 2, 3]
    assert Sampler(SamplingParams(seed=0)).sample(logits, []).top_logprobs is None
    assert Sampler(SamplingParams(logprobs=0, seed=0)).sample(logits, []).top_logprobs == []


def test_log_softmax_is_stable_for_large_logits():
    values = log_softmax(np.array([1e4, 1e4 - 1.0, -1e4], dtype=np.float32))
    assert np.all(np.isfinite(values[:2])) and math.fsum(np.exp(values)) == pytest.approx(1.0)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_broken_logits_raise(bad):
    logits = _logits(10, 0)
    logits[3] = bad
    with pytest.raises(ValueError, match="NaN"):
        Sampler(SamplingParams()).sample(logits, [])


# ---- validation ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1), ("temperature", float("nan")), ("temperature", "hot"),
        ("top_k", -1), ("top_k", 2.5), ("top_k", True),
        ("top_p", 0.0), ("top_p", 1.5),
        ("min_p", -0.1), ("min_p", 1.01),
        ("repetition_penalty", 0.0), ("repetition_penalty", float("inf")),
        ("seed", -1), ("seed", 1.0),
        ("max_tokens", 0), ("max_tokens", None),
        ("stop", "###"), ("stop", [""]), ("stop", [1]),
        ("logprobs", -1), ("logprobs", MAX_TOP_LOGPROBS + 1),
        ("ignore_eos", "yes"),
    ],
)
def test_a_value_out_of_range_cannot_be_built_and_the_error_names_its_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=f"^{field} must be"):  # nor reached by replacing a field of valid ones
        dataclasses.replace(SamplingParams(), **{field: value})


def test_the_edges_are_accepted():
    params = SamplingParams(temperature=0, top_k=0, top_p=1.0, min_p=1.0, seed=0, max_tokens=1, stop=["x"],
                            logprobs=MAX_TOP_LOGPROBS, ignore_eos=True)
    assert params.stop == ("x",)


def test_params_cannot_change_after_they_were_checked():
    params = SamplingParams(stop=["x"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.max_tokens = 0
    with pytest.raises(AttributeError):
        params.stop.append("")  # kept as a tuple: the list the caller passed is not shared either


# ---- stop strings ------------------------------------------------------------------------------------


def _feed(matcher: StopMatcher, deltas: list[str]) -> tuple[list[str], bool]:
    emitted, stopped = [], False
    for delta in deltas:
        text, stopped = matcher.push(delta)
        emitted.append(text)
        if stopped:
            break
    if not stopped:
        emitted.append(matcher.flush())
    return emitted, stopped


def test_stop_string_split_across_deltas():
    emitted, stopped = _feed(StopMatcher(["</answer>"]), ["The answer is 4", ".</ans", "wer> and more"])
    assert stopped
    assert emitted == ["The answer is 4", ".", ""]


def test_possible_stop_prefix_is_held_then_released():
    matcher = StopMatcher(["###"])
    assert matcher.push("a #") == ("a ", False)
    assert matcher.push("#") == ("", False)
    assert matcher.push("!") == ("##!", False)  # not a stop after all
    assert matcher.push("end#") == ("end", False)
    assert matcher.flush() == "#"


def test_stop_in_one_delta_with_text_after():
    assert StopMatcher(["STOP"]).push("abcSTOPdef") == ("abc", True)


def test_stop_at_the_very_start():
    matcher = StopMatcher(["\n\n"])
    assert matcher.push("\n") == ("", False)
    assert matcher.push("\nrest") == ("", True)
    assert matcher.push("more") == ("", True)
    assert matcher.flush() == ""


def test_first_completed_stop_wins():
    assert StopMatcher(["abc", "b"]).push("xabc") == ("xa", True)
    assert StopMatcher(["bc", "c"]).push("abcd") == ("a", True)
    assert StopMatcher(["c", "bc"]).push("abcd") == ("a", True)


def test_overlapping_self_prefix():
    emitted, stopped = _feed(StopMatcher(["aab"]), list("xaaab"))
    assert stopped and "".join(emitted) == "xa"


def test_no_stop_strings_passes_everything_through():
    matcher = StopMatcher([])
    assert matcher.push("anything") == ("anything", False)
    assert matcher.flush() == ""
