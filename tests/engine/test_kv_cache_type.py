"""kv_cache_type "f16" (Model, Engine; the daemon's config key): attention layers keep their
keys and values in float16, half the memory of float32, while a request's tokens still do not
depend on what else runs, on where its prompt is cut, or on prefix reuse. Latent (MLA) and
recurrent (DeltaNet) states stay float32."""

from __future__ import annotations

import numpy as np
import pytest

from colibrid.engine.forward.deltanet import DeltaNetState
from colibrid.engine.forward.kv_cache import KVCache, LatentCache, RingKVCache
from tests.engine.test_batch import _requests, _run, _summary
from tests.engine.test_prefix_cache import CHUNK, GREEDY, KINDS, SEEDED, _chat, _turns


def _engine(packs, spec, kv_cache_type, quant="q8_0"):
    from colibrid.engine.engine import Engine
    from colibrid.pack.reader import Pack

    engine = Engine(Pack.open(packs.pack(spec, quant)), kv_cache_type=kv_cache_type)
    engine.model.max_step_tokens = CHUNK
    return engine


@pytest.mark.parametrize("spec", KINDS, ids=lambda s: s.name)
def test_attention_caches_are_float16_and_the_other_states_stay_float32(spec, packs):
    half, full = (_engine(packs, spec, kind).new_session(64).state for kind in ("f16", "f32"))
    saved = 0
    for h, f in zip(half.layers, full.layers):
        assert type(h) is type(f)
        if isinstance(h, (KVCache, RingKVCache)):
            assert h._keys.dtype == h._values.dtype == np.float16 and f._keys.dtype == np.float32
            assert h.nbytes * 2 == f.nbytes
            saved += h.nbytes
        else:
            assert isinstance(h, (LatentCache, DeltaNetState)) and h.nbytes == f.nbytes
    assert (saved > 0) == (spec.arch != "deepseek_v3")  # V3's layers are all latent attention
    assert half.nbytes == full.nbytes - saved  # what a request reserves in the KV budget


@pytest.mark.parametrize("spec", KINDS, ids=lambda s: s.name)
def test_with_float16_caches_a_request_among_others_gets_exactly_its_tokens_alone(spec, packs):
    engine = _engine(packs, spec, "f16")
    requests = _requests(engine.config.vocab_size)
    alone = [_run(engine, [request], max_batch=1, prefill_chunk=5, join_every=0)[0] for request in requests]
    batched = _run(engine, requests, max_batch=8, prefill_chunk=5, join_every=2)
    assert [_summary(o) for o in batched] == [_summary(o) for o in alone]
    if spec.arch != "qwen3_5_moe":  # nor on where the prompt is cut (DeltaNet's chunks are numerics of their own)
        whole_prompt = [list(engine.generate(prompt, params)) for prompt, params in requests]
        assert [_summary(o) for o in whole_prompt] == [_summary(o) for o in alone]


@pytest.mark.parametrize("spec", KINDS, ids=lambda s: s.name)
def test_with_float16_caches_prefix_reuse_gets_the_fresh_tokens(spec, packs):
    engine = _engine(packs, spec, "f16")
    turns = _turns(engine.config.vocab_size)
    for params in (GREEDY, SEEDED):
        reused = _chat(engine, turns, params, 1 << 30)
        assert [r[0] for r in reused] == [f[0] for f in _chat(engine, turns, params, 0)]
        assert reused[2][1] > 0  # the third turn did resume


def test_float16_caches_change_the_logits_by_float16_rounding_only(packs):
    """The first position attends to its own value only: off by that value's rounding. Later
    ones by a few percent at most in this random model's peaky attention (a near-tie in the
    router can flip an expert at one position or another, hence the median)."""
    spec = KINDS[0]  # OLMoE: every layer full attention
    engines = {kind: _engine(packs, spec, kind) for kind in ("f32", "f16")}
    prompt = _turns(engines["f32"].config.vocab_size, seed=5)[0]
    logits = {kind: engine.new_session(64).forward(prompt) for kind, engine in engines.items()}
    scale = np.abs(logits["f32"]).max()
    difference = np.abs(logits["f16"] - logits["f32"]).max(axis=1)  # (T,) per position
    assert 0 < difference[0] < 1e-3 * scale
    assert np.all(difference[1:] > 0) and np.median(difference) < 3e-2 * scale


def test_an_unknown_kv_cache_type_is_refused(packs):
    with pytest.raises(ValueError, match="kv_cache_type must be one of f32, f16"):
        _engine(packs, KINDS[0], "bf16")
