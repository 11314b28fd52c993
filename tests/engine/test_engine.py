"""The engine's public API end to end on a tiny pack: prompts (raw and chat),
streamed events, stop strings, logprobs and usage."""

from __future__ import annotations

import numpy as np
import pytest

from tests.tiny_checkpoints import CheckpointSpec

SPEC = CheckpointSpec("qwen3_moe")


@pytest.fixture(scope="module")
def engine(packs):
    from colibrid.engine import load

    return load(packs.pack(SPEC, "q8_0"))


def test_chat_prompt_uses_the_template(engine):
    ids = engine.prompt_ids(prompt="hello", system="be brief")
    text = engine.tokenizer.decode(ids)
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    raw = engine.prompt_ids(prompt="hello", raw=True)
    assert engine.tokenizer.decode(raw) == "hello"


def test_generate_streams_events_then_done(engine):
    from colibrid.engine.generate import GenerationDone, GenerationEvent
    from colibrid.engine.sampling import SamplingParams

    prompt = engine.prompt_ids(prompt="def fibonacci(n):", raw=True)
    events = list(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)))
    tokens, done = events[:-1], events[-1]
    assert all(isinstance(e, GenerationEvent) for e in tokens) and isinstance(done, GenerationDone)
    assert len(tokens) == 12 and done.finish_reason == "length"
    assert done.prompt_tokens == len(prompt) and done.generated_tokens == 12
    assert done.text == "".join(e.text for e in tokens)
    assert [e.token_id for e in tokens] == engine.greedy(prompt, 12)
    for e in tokens:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0][0] == e.token_id  # greedy picks the best
        assert e.logprob <= 0 and e.logprob == pytest.approx(e.top_logprobs[0][1])


def test_seeded_sampling_is_reproducible(engine):
    from colibrid.engine.sampling import SamplingParams

    prompt = engine.prompt_ids(prompt="import os", raw=True)
    params = dict(temperature=0.9, top_k=40, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    first = [e.token_id for e in engine.generate(prompt, SamplingParams(**params)) if hasattr(e, "token_id")]
    second = [e.token_id for e in engine.generate(prompt, SamplingParams(**params)) if hasattr(e, "token_id")]
    assert first == second and len(first) == 16


def test_decode_with_kv_cache_equals_full_forward(engine):
    ids = np.random.default_rng(3).integers(0, engine.config.vocab_size, 24).tolist()
    full = engine.forward(ids)
    session = engine.new_session()
    parts = [session.forward(ids[:10]), *(session.forward([t]) for t in ids[10:])]
    np.testing.assert_allclose(np.concatenate(parts), full, rtol=0, atol=1e-4 * np.abs(full).max())
