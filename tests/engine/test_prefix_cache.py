"""Prefix reuse (engine/prefix_cache.py, the LayerState/LayerPrefix interface): a request whose
token ids begin with a finished sequence's prefills only the rest, and gets exactly the tokens
a fresh engine gives it, for every kind of sequence state: reused where the state allows it,
declined where it does not, and this file asserts which. Eviction keeps the cache in its
budget, and nothing half-done is ever kept."""

from __future__ import annotations

import numpy as np
import pytest

from colibrid.engine.generate import GenerationDone, GenerationEvent
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
    from colibrid.engine.kv_cache import KVCache, RingKVCache

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
