"""The fused attention step (one libcolibri call per layer: norm, q/k/v, q/k norms, clamp,
RoPE, cache append, attention, output product, residual) gives exactly the numbers of the
step-by-step path it replaces, for every attention feature the architectures use: prefill,
decode over a KV cache, and greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest

from tests.tiny_checkpoints import CheckpointSpec

SPECS = [
    CheckpointSpec("olmoe", {"clip_qkv": 0.5}),  # full q/k norm, clamped q/k/v
    CheckpointSpec("qwen3_moe", {"head_dim": 32}),  # per-head q/k norm, Q != D
    CheckpointSpec("qwen2_moe", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),  # biases, window
    CheckpointSpec("mixtral", {"num_key_value_heads": 1, "sliding_window": 5}),  # GQA 4:1, window
    # v norm, post-attention norm, values from the k projection on the full layer (Hd 32, 1 kv head), scale 1
    CheckpointSpec("gemma4_text", {"hidden_size_per_layer_input": 0}),
]
PROMPT = [5, 17, 42, 99, 3, 50, 7, 61, 11, 20, 31, 8]


def _engines(path):
    from colibrid.engine.engine import Engine
    from colibrid.pack.reader import Pack

    fused, stepwise = Engine(Pack.open(path)), Engine(Pack.open(path))
    for layer in stepwise.model.layers:
        layer.mixer.fused = None  # the numpy / separate-call path
    assert all(layer.mixer.fused is not None for layer in fused.model.layers)
    return fused, stepwise


@pytest.mark.parametrize("quant", ["f32", "q4_g64"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_fused_attention_equals_the_step_by_step_path(spec, quant, packs):
    fused, stepwise = _engines(packs.pack(spec, quant))
    np.testing.assert_array_equal(fused.forward(PROMPT), stepwise.forward(PROMPT))
    sessions = fused.new_session(), stepwise.new_session()
    for part in (PROMPT[:7], PROMPT[7:8], PROMPT[8:9], PROMPT[9:]):  # prefill, then decode steps
        a, b = (s.forward(part) for s in sessions)
        np.testing.assert_array_equal(a, b)
    assert fused.greedy(PROMPT, 8) == stepwise.greedy(PROMPT, 8)


def test_decode_rows_equal_prefill_rows_bit_for_bit(packs):
    engine, _ = _engines(packs.pack(SPECS[0], "q4_g64"))
    full = engine.forward(PROMPT)
    session = engine.new_session()
    rows = [session.forward(PROMPT[:5])] + [session.forward([t]) for t in PROMPT[5:]]
    np.testing.assert_array_equal(np.concatenate(rows), full)


def test_specs_exercise_the_features_they_claim(packs):
    from colibrid.pack.reader import Pack

    manifests = [Pack.open(packs.pack(spec, "f32")).manifest for spec in SPECS]
    configs = [m.model for m in manifests]
    assert configs[0].qk_norm == "full" and configs[0].clip_qkv == 0.5
    assert configs[1].qk_norm == "head" and configs[1].num_heads * configs[1].head_dim != configs[1].hidden_size
    assert "qkv_bias" in manifests[2].optional_tensors and any(configs[2].sliding_window) and not all(configs[2].sliding_window)
    assert configs[3].num_kv_heads == 1 and all(configs[3].sliding_window)
    assert configs[4].v_norm and "post_norms" in manifests[4].optional_tensors and configs[4].values_from_keys and configs[4].layer_head_dim


def test_the_fused_step_fills_the_cache_in_parts_and_refuses_past_its_end(packs):
    from colibrid.engine.forward.kv_cache import KVCache
    from colibrid.engine.forward.sequence_state import SequenceState

    fused, stepwise = _engines(packs.pack(SPECS[2], "q8_0"))
    config = fused.config
    states = [SequenceState([KVCache(config.num_kv_heads, config.head_dim, 16)
                             for _ in range(config.num_layers)], 16) for _ in range(2)]
    for part in (PROMPT[:3], PROMPT[3:4], PROMPT[4:9], PROMPT[9:]):
        a, b = (e.model.forward(np.asarray(part), state) for e, state in zip((fused, stepwise), states))
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="context full"):
        fused.model.forward(np.asarray(PROMPT[:5]), states[0])  # 12 + 5 > 16
    assert states[0].length == len(PROMPT)
