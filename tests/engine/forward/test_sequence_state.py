"""A sequence's state is one object per layer, made by that layer's mixer: sliding-window
layers keep a bounded ring of keys, full layers every key. Splitting input into steps and
keeping windows in rings changes no number: the logits equal those of one pass over a flat
cache, bit for bit, while the ring's memory stays fixed as the context grows."""

from __future__ import annotations

import numpy as np
import pytest

from tests.tiny_checkpoints import CheckpointSpec

WINDOWED = [
    CheckpointSpec("qwen2_moe", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
    CheckpointSpec("gpt_oss", {}),  # sliding window 4 on every other layer, sinks
]


def _engine(path, max_step_tokens):
    from colibrid.engine.engine import Engine
    from colibrid.pack.reader import Pack

    engine = Engine(Pack.open(path), max_context=64)
    engine.model.max_step_tokens = max_step_tokens
    return engine


@pytest.mark.parametrize("spec", WINDOWED, ids=lambda s: s.name)
def test_windowed_layers_keep_a_ring_and_give_the_flat_cache_logits(spec, packs):
    from colibrid.engine.forward.kv_cache import KVCache, RingKVCache

    path = packs.pack(spec, "q8_0")
    stepped, whole = _engine(path, 3), _engine(path, 512)
    ringed = stepped.new_session()
    windows = stepped.config.sliding_window
    assert [isinstance(s, RingKVCache) for s in ringed.state.layers] == [w is not None for w in windows]
    assert all(isinstance(s, KVCache) for s in whole.new_session().state.layers)  # window + 511 > 64: flat
    ring_bytes = [s.nbytes for s in ringed.state.layers if isinstance(s, RingKVCache)]

    prompt = list(np.random.default_rng(0).integers(0, stepped.config.vocab_size, 17))
    flat = whole.new_session()
    np.testing.assert_array_equal(ringed.forward(prompt), flat.forward(prompt))  # 17 tokens in steps of 3
    token = prompt[-1]
    for _ in range(24):  # decode past several wraps of the ring
        a, b = ringed.forward([token]), flat.forward([token])
        np.testing.assert_array_equal(a, b)
        token = int(a[-1].argmax())
    assert [s.nbytes for s in ringed.state.layers if isinstance(s, RingKVCache)] == ring_bytes  # bounded
    assert ringed.n_past == flat.n_past == 41


def test_a_long_prompt_runs_in_steps_with_the_one_pass_logits(packs):
    path = packs.pack(CheckpointSpec("olmoe", {}), "q4_g64")
    stepped, whole = _engine(path, 4), _engine(path, 512)
    prompt = list(np.random.default_rng(1).integers(0, whole.config.vocab_size, 11))
    np.testing.assert_array_equal(stepped.forward(prompt), whole.forward(prompt))
    last = stepped.new_session().forward(prompt, all_logits=False)
    np.testing.assert_array_equal(last, whole.forward(prompt)[-1:])


def test_the_state_refuses_tokens_past_its_context(packs):
    engine = _engine(packs.pack(CheckpointSpec("olmoe", {}), "f32"), 4)
    session = engine.new_session(max_context=10)
    session.forward(list(range(8)))
    with pytest.raises(ValueError, match="context full: 11 tokens > 10"):
        session.forward([1, 2, 3])
    assert session.n_past == 8


def test_shared_layer_states_are_counted_once():
    from colibrid.engine.forward.kv_cache import KVCache
    from colibrid.engine.forward.sequence_state import SequenceState

    cache, other = KVCache(2, 8, 16), KVCache(2, 8, 16)
    assert SequenceState([cache, other, cache], 16).nbytes == cache.nbytes + other.nbytes
