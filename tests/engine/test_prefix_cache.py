"""Prefix reuse (engine/prefix_cache.py, the LayerState/LayerPrefix interface): a request whose
token ids begin with a finished sequence's prefills only the rest, and gets exactly the tokens
a fresh engine gives it, for every kind of sequence state: reused where the state allows it,
declined where it does not, and this file asserts which. Eviction keeps the cache in its
budget, and nothing half-done is ever kept."""

from __future__ import annotations

import numpy as np
import pytest

from colibrid.engine.generate import GenerationEvent
from colibrid.engine.sampling import SamplingParams
from tests.engine.test_batch import BIG_BUDGET, STATE_KINDS, _summary
from tests.tiny_checkpoints import CheckpointSpec

CHUNK = 8  # prefill_chunk and max_step_tokens of these tests: gpt-oss' window-4 layers keep rings of 11 rows
# Llama 4's chunked-local layers (chunks of 8) keep rings too
KINDS = STATE_KINDS + [CheckpointSpec("llama4", {})]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=9, ignore_eos=True, logprobs=2)


def _engine(packs, spec, quant, max_step_tokens=CHUNK):
    from colibrid.engine.engine import Engine
    from colibrid.pack.reader import Pack

    engine = Engine(Pack.open(packs.pack(spec, quant)))
    engine.model.max_step_tokens = max_step_tokens
    return engine


def _run_one(engine, batch, prompt, params):
    """Runs one request alone in ``batch`` to its end: its outcomes."""
    generation, session = engine.start_generation(prompt, params, resumable=batch.keeps_prefixes)
    batch.admit("request", generation, session)
    outcomes = []
    while len(batch):
        for _, produced in batch.step():
            outcomes.extend(produced)
    return outcomes


def _chat(engine, turns, params, prefix_cache_bytes):
    """A conversation of len(turns) turns, each prompt the last one, its answer and the next
    message's ids: every turn in one batch with a prefix cache, or (0) each in a fresh batch.
    Returns each turn's (what the client sees, cached prompt tokens, prompt length)."""
    shared = engine.new_batch(1, CHUNK, BIG_BUDGET, prefix_cache_bytes) if prefix_cache_bytes else None
    history, results = [], []
    for message in turns:
        prompt = history + message
        batch = shared if shared is not None else engine.new_batch(1, CHUNK, BIG_BUDGET)
        outcomes = _run_one(engine, batch, prompt, params)
        history = prompt + [o.token_id for o in outcomes if isinstance(o, GenerationEvent)]
        results.append((_summary(outcomes), outcomes[-1].cached_prompt_tokens, len(prompt)))
    return results


def _turns(vocab_size, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab_size, size=n).tolist() for n in (21, 7, 9)]


@pytest.mark.parametrize("quant", ["q8_0", "q4_g64"])
@pytest.mark.parametrize("spec", KINDS, ids=lambda s: s.name)
def test_a_three_turn_chat_reuses_its_prefix_and_gets_the_fresh_tokens(spec, quant, packs):
    engine = _engine(packs, spec, quant)
    turns = _turns(engine.config.vocab_size)
    for params in (GREEDY, SEEDED):
        fresh = _chat(engine, turns, params, 0)
        reused = _chat(engine, turns, params, BIG_BUDGET)
        assert [r[0] for r in reused] == [f[0] for f in fresh]
        assert [f[1] for f in fresh] == [0, 0, 0]
        cached = [r[1] for r in reused]
        answers = [r[0][3] for r in reused]
        prompts = [r[2] for r in reused]
        if spec.arch == "qwen3_5_moe":
            # DeltaNet resumes where the previous prompt's last whole chunk ended (prefill_chunk)
            assert cached == [0, prompts[0] // CHUNK * CHUNK, prompts[1] // CHUNK * CHUNK]
        else:
            # full KV, latents and rings (the window before it is still held): all the previous
            # turn held, its prompt and every answer token but the last (never fed)
            assert cached == [0, prompts[0] + answers[0] - 1, prompts[1] + answers[1] - 1]


@pytest.mark.parametrize("spec", KINDS, ids=lambda s: s.name)
def test_the_same_document_asked_twice_reuses_it_or_declines_as_its_state_allows(spec, packs):
    engine = _engine(packs, spec, "q8_0")
    document = _turns(engine.config.vocab_size, seed=11)[0] * 2  # 42 tokens
    question = [5, 6, 7]
    batch = engine.new_batch(2, CHUNK, BIG_BUDGET, BIG_BUDGET)
    first = _run_one(engine, batch, document + question, GREEDY)
    again = _run_one(engine, batch, document + question, GREEDY)
    other = _run_one(engine, batch, document + [9, 9], GREEDY)
    fresh = [_run_one(engine, engine.new_batch(1, CHUNK, BIG_BUDGET), prompt, GREEDY)
             for prompt in (document + question, document + [9, 9])]
    assert [_summary(first), _summary(again), _summary(other)] == [_summary(fresh[0]), _summary(fresh[0]),
                                                                   _summary(fresh[1])]
    cached = [outcomes[-1].cached_prompt_tokens for outcomes in (first, again, other)]
    windows = [w for w in (engine.config.sliding_window or []) if w] + \
        ([c for c in engine.config.attention_chunk if c] if engine.config.attention_chunk else [])
    if spec.arch == "qwen3_5_moe":
        assert cached == [0, 40, 40]  # the last whole prompt chunk (5 x 8) below the 44 tokens
    elif windows:
        # a ring holds the window before the last CHUNK positions only: 12 answer tokens moved past it
        assert cached == [0, 0, 0]
    else:
        assert cached == [0, 44, 42]  # all but the last prompt token; the document where the ask differs


# Not the hybrid: its attention layers read what the DeltaNet layers before them computed,
# which depends on where the prompt was cut, so it resumes only where its prompt chunks ended.
POSITION_CACHES = [spec for spec in STATE_KINDS if spec.arch != "qwen3_5_moe"]


@pytest.mark.parametrize("quant", ["q8_0", "q4_g64"])
@pytest.mark.parametrize("spec", POSITION_CACHES, ids=lambda s: s.name)
def test_rows_written_by_decode_steps_equal_a_prefill_of_the_same_tokens(spec, quant, packs):
    """What makes reuse of an answer's tokens exact: each position's keys, values or latents
    do not depend on the step that wrote them (a decode token alone, a chunk, one pass)."""
    engine = _engine(packs, spec, quant, max_step_tokens=512)
    prompt = _turns(engine.config.vocab_size)[0]
    batch = engine.new_batch(1, 5, BIG_BUDGET)
    generation, decoded = engine.start_generation(prompt, GREEDY)
    batch.admit("a", generation, decoded)
    while len(batch):
        batch.step()
    tokens = generation.fed_token_ids()
    assert tokens.shape[0] == len(prompt) + GREEDY.max_tokens - 1 == decoded.n_past
    prefilled = engine.new_session(max_context=decoded.max_context)
    prefilled.forward(tokens, all_logits=False)  # one pass
    compared = 0
    for a, b in zip(decoded.state.layers, prefilled.state.layers):
        kept_a, kept_b = a.keep(tokens.shape[0]), b.keep(tokens.shape[0])
        for x, y in zip(kept_a.buffers, kept_b.buffers):
            np.testing.assert_array_equal(x, y)
            compared += 1
    assert compared >= 2


@pytest.mark.parametrize("entry_context, new_context", [(600, 40), (40, 600)], ids=["ring-to-flat", "flat-to-ring"])
def test_a_window_layer_resumes_across_a_ring_and_a_flat_cache(entry_context, new_context, packs):
    """Whether a window layer keeps a ring depends on the sequence's size: an entry of one
    kind restores into a state of the other."""
    from colibrid.engine.forward.kv_cache import KVCache, RingKVCache

    engine = _engine(packs, STATE_KINDS[1], "q8_0", max_step_tokens=512)  # gpt-oss, window 4
    model = engine.model
    tokens = np.array(_turns(engine.config.vocab_size)[0] + _turns(engine.config.vocab_size, seed=4)[0][:14])  # 35
    entry = model.new_state(entry_context)
    kinds = {600: RingKVCache, 40: KVCache}
    assert isinstance(entry.layers[0], kinds[entry_context]) and isinstance(entry.layers[1], KVCache)
    model.forward(tokens[:30], entry)
    prefix = entry.keep()
    assert prefix.resume_to == 30
    resumed, fresh = model.new_state(new_context), model.new_state(new_context)
    assert isinstance(resumed.layers[0], kinds[new_context])
    prefix.restore(resumed, 30)
    np.testing.assert_array_equal(model.forward(tokens[30:], resumed), model.forward(tokens, fresh)[30:])


# -- the cache itself, on states of one small full-attention layer ---------------------------

def _state(token_ids, seed=0, max_tokens=64):
    """A state of one full-attention layer that has processed ``token_ids``: each position's
    keys and values are a function of the ids so far, as a model's are."""
    from colibrid.engine.forward.kv_cache import KVCache
    from colibrid.engine.forward.sequence_state import SequenceState

    state = SequenceState([KVCache(1, 4, max_tokens)], max_tokens)
    n = len(token_ids)
    if n:
        keys = np.cumsum(np.asarray(token_ids, np.float32))[:, None, None] * np.arange(1, 5, dtype=np.float32)
        state.layers[0].write(0, keys, -keys)
    state.advance(n)
    return state


def _kept_rows(state, n):
    return state.layers[0].keep(n).buffers


def _size(n_tokens):
    from colibrid.engine.prefix_cache import ENTRY_OVERHEAD_BYTES

    return 2 * n_tokens * 16 + 4 * n_tokens + ENTRY_OVERHEAD_BYTES  # keys + values, ids, bookkeeping


def _ids(seed, n):
    return np.random.default_rng(seed).integers(0, 1000, n).tolist()


def test_a_lookup_resumes_from_the_longest_kept_prefix_with_its_rows():
    from colibrid.engine.prefix_cache import PrefixCache

    cache = PrefixCache(1 << 20)
    a = _ids(1, 40)
    b = a[:20] + _ids(2, 28)
    assert cache.keep(a, _state(a)) and cache.keep(b, _state(b))
    prompt = b[:37] + [7, 7, 7]
    resumed = _state([])
    assert cache.resume(resumed, prompt) == 37 and resumed.length == 37
    for got, want in zip(_kept_rows(resumed, 37), _kept_rows(_state(prompt), 37)):
        np.testing.assert_array_equal(got, want)
    assert cache.resume(_state([]), a) == 39  # the whole prompt kept: its last token is still fed
    assert cache.resume(_state([]), a[:15] + [1] * 30) == 0  # less than one block in common
    status = cache.status()
    assert (status["lookups"], status["hits"], status["tokens_reused"], status["entries"]) == (3, 2, 76, 2)


def test_the_least_recently_used_entry_leaves_for_a_new_one_and_the_budget_holds():
    from colibrid.engine.prefix_cache import PrefixCache

    a, b, c = _ids(1, 32), _ids(2, 32), _ids(3, 32)
    cache = PrefixCache(2 * _size(32) + 100)  # room for two
    cache.keep(a, _state(a))
    cache.keep(b, _state(b))
    assert cache.status()["used_bytes"] == 2 * _size(32)
    assert cache.resume(_state([]), a + [1]) == 32  # a is now the more recently used
    cache.keep(c, _state(c))
    assert cache.resume(_state([]), b + [1]) == 0  # b left for c
    assert cache.resume(_state([]), a + [1]) == 32 and cache.resume(_state([]), c + [1]) == 32
    status = cache.status()
    assert (status["entries"], status["evicted"], status["used_bytes"]) == (2, 1, 2 * _size(32))
    assert status["used_bytes"] <= status["budget_bytes"]


def test_what_cannot_fit_or_is_too_short_is_not_kept():
    from colibrid.engine.prefix_cache import PrefixCache

    a = _ids(1, 32)
    cache = PrefixCache(_size(32) - 1)
    assert not cache.keep(a, _state(a))
    assert not PrefixCache(1 << 20).keep(a[:15], _state(a[:15]))  # shorter than a block: never found
    assert cache.status()["used_bytes"] == 0 and cache.status()["not_kept"] == 1
    with pytest.raises(ValueError, match="token ids"):
        cache.keep(a, _state(a[:31]))


def test_an_entry_that_a_longer_one_extends_is_replaced_by_it():
    from colibrid.engine.prefix_cache import PrefixCache

    a = _ids(1, 32)
    longer = a + _ids(2, 20)
    cache = PrefixCache(1 << 20)
    cache.keep(a, _state(a))
    cache.keep(longer, _state(longer))
    status = cache.status()
    assert (status["entries"], status["evicted"], status["used_bytes"]) == (1, 0, _size(52))
    assert cache.resume(_state([]), a + [5]) == 32


def test_a_scope_reuses_only_its_own_prefixes():
    """The daemon's scope is the asking user: what one user asked is neither reused by nor
    revealed to another (by cached_prompt_tokens, or a fast first token)."""
    from colibrid.engine.prefix_cache import PrefixCache

    cache = PrefixCache(1 << 20)
    a = _ids(1, 40)
    cache.keep(a, _state(a), scope=b"uid 1000")
    assert cache.resume(_state([]), a + [1], scope=b"uid 1001") == 0
    assert cache.resume(_state([]), a + [1]) == 0
    assert cache.resume(_state([]), a + [1], scope=b"uid 1000") == 40
    cache.keep(a, _state(a), scope=b"uid 1001")  # the same tokens for another user: an entry of its own
    assert cache.status()["entries"] == 2


def test_a_hash_collision_never_reuses_other_tokens(monkeypatch):
    """The block keys only find candidates: the ids themselves decide."""
    from colibrid.engine import prefix_cache

    monkeypatch.setattr(prefix_cache, "block_keys",
                        lambda ids, scope=b"": [b"same"] * (len(ids) // prefix_cache.BLOCK_TOKENS))
    cache = prefix_cache.PrefixCache(1 << 20)
    a = _ids(1, 40)
    cache.keep(a, _state(a))
    assert cache.resume(_state([]), _ids(2, 40)) == 0
    assert cache.resume(_state([]), a[:25] + [1, 2]) == 25


def test_kept_nbytes_is_the_size_of_what_is_kept_for_every_state_kind(packs):
    for spec in KINDS:
        engine = _engine(packs, spec, "q8_0")
        prompt = _turns(engine.config.vocab_size)[0]
        batch = engine.new_batch(1, CHUNK, BIG_BUDGET, BIG_BUDGET)
        generation, session = engine.start_generation(prompt, GREEDY, resumable=True)
        batch.admit("a", generation, session)
        while len(batch):
            batch.step()
        assert session.state.kept_nbytes() == session.state.keep().nbytes > 0, spec.name


# -- the batch: what is kept, when it is looked up -------------------------------------------

def _until_done(batch, outcomes=None):
    outcomes = {} if outcomes is None else outcomes
    while len(batch):
        for sequence, produced in batch.step():
            outcomes.setdefault(sequence.key, []).extend(produced)
    return outcomes


def test_a_prepared_request_whose_entry_is_evicted_before_it_joins_prefills_it_all(packs):
    engine = _engine(packs, STATE_KINDS[0], "q8_0")
    a = _turns(engine.config.vocab_size)[0] + [9] * 20
    b = _turns(engine.config.vocab_size, seed=8)[0] + [9] * 20
    batch = engine.new_batch(2, CHUNK, BIG_BUDGET, BIG_BUDGET)
    _run_one(engine, batch, a, GREEDY)
    batch.prefix_cache.budget_bytes = batch.prefix_cache.used_bytes  # room for one entry of this shape
    follow_up = a + [4, 5, 6]
    waiting = engine.start_generation(follow_up, GREEDY, resumable=True)  # prepared, not yet admitted
    _run_one(engine, batch, b, GREEDY)  # b's entry takes a's place
    assert batch.prefix_cache.status()["evicted"] == 1
    batch.admit("follow-up", *waiting)
    outcomes = _until_done(batch)["follow-up"]
    fresh = _run_one(engine, engine.new_batch(1, CHUNK, BIG_BUDGET), follow_up, GREEDY)
    assert _summary(outcomes) == _summary(fresh) and outcomes[-1].cached_prompt_tokens == 0


def test_an_entry_evicted_while_its_copy_runs_changes_nothing(packs):
    engine = _engine(packs, STATE_KINDS[0], "q8_0")
    a = _turns(engine.config.vocab_size)[0] + [9] * 20
    batch = engine.new_batch(2, CHUNK, BIG_BUDGET, BIG_BUDGET)
    _run_one(engine, batch, a, GREEDY)
    follow_up = a + [4, 5, 6]
    batch.admit("follow-up", *engine.start_generation(follow_up, GREEDY, resumable=True))
    outcomes = {sequence.key: produced for sequence, produced in batch.step()}  # its last prompt token, a sample
    assert outcomes["follow-up"]
    batch.prefix_cache.clear()  # as eviction would, while the follow-up decodes from its copy
    outcomes = _until_done(batch, outcomes)["follow-up"]
    fresh = _run_one(engine, engine.new_batch(1, CHUNK, BIG_BUDGET), follow_up, GREEDY)
    assert _summary(outcomes) == _summary(fresh)
    assert outcomes[-1].cached_prompt_tokens == len(a)


def test_cancelled_and_failed_sequences_are_never_kept(packs):
    from colibrid.engine.batch import StepFailed

    engine = _engine(packs, STATE_KINDS[0], "q8_0")
    prompt = _turns(engine.config.vocab_size)[0]
    batch = engine.new_batch(2, CHUNK, BIG_BUDGET, BIG_BUDGET)
    batch.admit("cancelled", *engine.start_generation(prompt, GREEDY, resumable=True))
    for _ in range(5):
        batch.step()
    batch.remove("cancelled")
    batch.admit("failed", *engine.start_generation(prompt, GREEDY, resumable=True))
    batch.step()

    def broken(inputs):
        raise RuntimeError("an expert could not be read")

    engine.model.forward_batch, working = broken, engine.model.forward_batch
    with pytest.raises(StepFailed):
        batch.step()
    engine.model.forward_batch = working
    assert len(batch) == 0 and batch.prefix_cache_status()["entries"] == 0
    _run_one(engine, batch, prompt, GREEDY)  # one that ends is
    assert batch.prefix_cache_status()["entries"] == 1
