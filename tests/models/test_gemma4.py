"""Gemma 4 with the MoE block (gemma4_text) is the same model as transformers'
Gemma4ForCausalLM: sliding layers with a window shorter than the prompt and full layers of
another head width and kv head count with proportional RoPE, q/k/v norms, values from the
keys' projection, the dense MLP beside the routed experts (GeGLU both), the router's own norm
and per-expert scale, per-layer input embeddings, the layer scalar, embedding scaling and
logit soft-capping; the text model of the multimodal Gemma4ForConditionalGeneration converts
to the same pack; the published config.json reads as the published model (25.2 B / 3.8 B)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from colibrid.models import UnsupportedConfig, architecture_for
from colibrid.models.model_config import parameter_counts
from tests.tiny_checkpoints import CheckpointSpec, assert_same_model, load_reference, random_prompt

SLIDING, FULL = "sliding_attention", "full_attention"
SPECS = [
    # sliding (window 4 < the prompt), full, sliding, full; per-layer inputs, soft-capping,
    # full layers of Hd 32 and 1 kv head whose values are the k projection
    CheckpointSpec("gemma4_text", {"num_hidden_layers": 4, "layer_types": [SLIDING, FULL, SLIDING, FULL]}),
    # as the 26B-A4B is published: no per-layer inputs; here full layers with their own v
    # projection (2 kv heads of 32), no soft-capping, an untied head, a bf16 source
    CheckpointSpec("gemma4_text", {"hidden_size_per_layer_input": 0, "attention_k_eq_v": False,
                                   "final_logit_softcapping": None, "tie_word_embeddings": False, "sliding_window": 6},
                   dtype="bfloat16"),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_logits_and_greedy_match_transformers(spec, packs):
    from colibrid.engine import load

    engine = load(packs.pack(spec, "f32"))
    assert_same_model(load_reference(packs.checkpoint(spec)), engine, random_prompt(engine.config.vocab_size))


def test_decode_over_the_window_equals_prefill(packs):
    """Decode steps past the sliding window (4), through layers of two head shapes and the
    per-layer inputs, give the prefill's rows."""
    from colibrid.engine import load

    engine = load(packs.pack(SPECS[0], "f32"))
    ids = list(range(3, 3 + 14))
    full = engine.forward(ids)
    session = engine.new_session()
    rows = [session.forward(ids[:5])] + [session.forward([t]) for t in ids[5:]]
    np.testing.assert_allclose(np.concatenate(rows), full, rtol=0, atol=1e-6 * np.abs(full).max())


def test_specs_exercise_the_features_they_claim(packs):
    from colibrid.pack import Pack

    packs_ = [Pack.open(packs.pack(spec, "f32")) for spec in SPECS]
    first, second = (p.manifest.model for p in packs_)
    for pack in packs_:
        assert pack.manifest.optional_tensors == {"post_norms", "router_input_norm", "router_expert_scale", "layer_scalar"}
    for c in (first, second):
        assert c.architecture == "gemma4" and c.hidden_act == "gelu_pytorch_tanh" and c.expert_activation == "geglu_tanh"
        assert c.dense_mlp_with_experts and c.dense_ffn == 128 and all(c.moe_layers) and c.v_norm
        assert c.norm_topk_prob
        assert c.attention_scale == 1.0 and c.embed_scale == 8.0 and c.qk_norm == "head"
        assert c.full_attention_rope.type == "proportional" and c.full_attention_rope.partial_rotary_factor == 0.25
        assert c.rope.type == "default" and c.rope.theta == 10000.0 and c.full_attention_rope.theta == 1e6
    assert first.sliding_window == (4, None, 4, None) and first.layer_head_dim == (16, 32, 16, 32)
    assert first.layer_kv_heads == (2, 1, 2, 1) and first.values_from_keys and "layers.1.attn.v" not in \
        packs_[0].manifest.dense_tensors
    assert first.per_layer_input == 16 and first.final_logit_softcap == 30.0 and first.tie_word_embeddings
    assert second.sliding_window == (6, None) and second.layer_head_dim == (16, 32) and not second.layer_kv_heads
    assert not second.values_from_keys and "layers.1.attn.v" in packs_[1].manifest.dense_tensors
    assert second.per_layer_input == 0 and second.final_logit_softcap == 0.0 and not second.tie_word_embeddings
    scalars = [float(np.asarray(packs_[0].dense(f"layers.{layer}.layer_scalar").data)[0]) for layer in range(4)]
    assert all(abs(s - 1.0) > 1e-3 for s in scalars)  # the randomised buffer reached the pack


def test_the_fused_gate_up_is_split_gate_first(packs):
    """The pack's gate and up of expert 3 are the first and second F rows of transformers'
    (2F, D) gate_up_proj; the down is down_proj as it is."""
    import torch

    from colibrid.engine.experts.source import PreadExpertSource
    from colibrid.pack import Pack

    spec = SPECS[0]
    experts = load_reference(packs.checkpoint(spec)).model.layers[1].experts
    weights = PreadExpertSource(Pack.open(packs.pack(spec, "f32"))).get(1, 3)
    with torch.no_grad():
        gate_up, down = experts.gate_up_proj[3].numpy(), experts.down_proj[3].numpy()  # (2F, D), (D, F)
    np.testing.assert_array_equal(weights.gate.data, gate_up[:64])
    np.testing.assert_array_equal(weights.up.data, gate_up[64:])
    np.testing.assert_array_equal(weights.down.data, down)


def test_the_multimodal_checkpoint_converts_as_the_text_model(packs, tmp_path, caplog):
    """Gemma4ForConditionalGeneration (text_config, model.language_model.*, a vision tower)
    holding the text model's weights converts to the text model's pack, byte for byte."""
    import torch
    import transformers

    from colibrid.tools.convert.converter import convert
    from colibrid.tools.convert.quant_spec import parse_quant
    from colibrid.pack import Pack

    spec = SPECS[0]
    src = packs.checkpoint(spec)
    text = load_reference(src)
    vision = transformers.Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=8, patch_size=4,
                                             position_embedding_size=64)
    config = transformers.Gemma4Config(text_config=json.loads((src / "config.json").read_text()),
                                       vision_config=vision.to_dict(), audio_config=None)
    wrapped = transformers.Gemma4ForConditionalGeneration(config)
    with torch.no_grad():
        missing = wrapped.model.language_model.load_state_dict(text.model.state_dict())
    assert not missing.missing_keys and not missing.unexpected_keys
    out = tmp_path / "wrapped"
    wrapped.save_pretrained(out)
    for name in src.iterdir():
        if name.name.startswith("tokenizer") or name.name.endswith(".jinja"):
            shutil.copy(name, out / name.name)
    assert json.loads((out / "config.json").read_text())["model_type"] == "gemma4"
    with caplog.at_level("WARNING"):
        convert(out, tmp_path / "pack", parse_quant("f32"), progress=False)
    assert "gemma4: converting its gemma4 text model" in caplog.text
    plain, converted = packs.pack(spec, "f32"), tmp_path / "pack"
    assert Pack.open(converted).manifest.model == Pack.open(plain).manifest.model
    for name in ("dense.bin", "experts.bin"):
        assert (converted / name).read_bytes() == (plain / name).read_bytes()


# --- the published config.json ----------------------------------------------------------------

# google/gemma-4-26B-A4B-it's text_config, as published (transformers' Gemma4Config wraps it)
PUBLISHED_TEXT_CONFIG = {
    "model_type": "gemma4_text", "attention_bias": False, "attention_k_eq_v": True, "bos_token_id": 2,
    "enable_moe_block": True, "eos_token_id": 1, "final_logit_softcapping": 30.0, "global_head_dim": 512,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2816, "hidden_size_per_layer_input": 0,
    "intermediate_size": 2112, "layer_types": ([SLIDING] * 5 + [FULL]) * 5, "max_position_embeddings": 262144,
    "moe_intermediate_size": 704, "num_attention_heads": 16, "num_experts": 128, "num_global_key_value_heads": 2,
    "num_hidden_layers": 30, "num_key_value_heads": 8, "num_kv_shared_layers": 0, "rms_norm_eps": 1e-06,
    "rope_parameters": {FULL: {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
                        SLIDING: {"rope_theta": 10000.0, "rope_type": "default"}},
    "sliding_window": 1024, "tie_word_embeddings": True, "top_k_experts": 8, "use_bidirectional_attention": None,
    "use_double_wide_mlp": False, "vocab_size": 262144, "vocab_size_per_layer_input": 262144,
}


def test_the_published_config_reads_as_the_published_model():
    hf = dict(PUBLISHED_TEXT_CONFIG)
    arch = architecture_for(hf)
    config = arch.model_config(hf)
    full = [layer for layer in range(30) if config.sliding_window[layer] is None]
    assert full == [5, 11, 17, 23, 29] and set(config.sliding_window) == {1024, None}
    assert [config.head_dim_of(layer) for layer in (0, 5)] == [256, 512]
    assert [config.kv_heads_of(layer) for layer in (0, 5)] == [8, 2]
    assert not config.has_v_projection(5) and config.has_v_projection(0)
    assert config.num_experts == 128 and config.num_experts_per_tok == 8 and config.expert_ffn == 704
    assert config.per_layer_input == 0 and config.final_logit_softcap == 30.0 and config.eos_token_ids == (1,)
    total, active = parameter_counts(config, arch.optional_tensors(hf))
    assert round(total / 1e9, 1) == 25.2 and round(active / 1e9, 1) == 3.8  # the model card's numbers


def test_transformers_saved_per_layer_config_reads_the_same():
    """transformers 5.24 saves per_layer_config instead of global_head_dim and
    num_global_key_value_heads: the same layer shapes."""
    import transformers

    hf = dict(PUBLISHED_TEXT_CONFIG, num_hidden_layers=6, layer_types=[SLIDING] * 5 + [FULL])
    saved = json.loads(transformers.Gemma4TextConfig(**hf).to_json_string())
    assert "per_layer_config" in saved
    assert architecture_for(saved).model_config(saved) == architecture_for(hf).model_config(hf)


@pytest.mark.parametrize("key, value, named", [
    ("enable_moe_block", False, "enable_moe_block"),
    ("num_kv_shared_layers", 2, "num_kv_shared_layers"),
    ("hidden_activation", "silu", "hidden_activation"),
    ("use_bidirectional_attention", "all", "use_bidirectional_attention"),
    ("attention_bias", True, "attention_bias"),
    ("rope_parameters", {FULL: {"rope_type": "yarn", "rope_theta": 1e6}, SLIDING: {"rope_theta": 1e4}}, "rope_type 'yarn'"),
    ("layer_types", [SLIDING, "chunked_attention"] * 15, "layer_types"),
])
def test_unsupported_switches_are_refused_by_name(key, value, named):
    hf = dict(PUBLISHED_TEXT_CONFIG, **{key: value})
    with pytest.raises(UnsupportedConfig, match=named):
        architecture_for(hf).model_config(hf)


# --- a manifest the converter would not have written ------------------------------------------

MANIFEST_CORRUPTIONS = [
    ("a layer's head dim changed", lambda m: m["model"]["layer_head_dim"].__setitem__(1, 16),
     ["'layers.1.attn.q'", "the model needs [64, 64]"]),
    ("an odd head dim", lambda m: m["model"]["layer_head_dim"].__setitem__(1, 33), ["head dim 33 must be even"]),
    ("kv heads that do not divide the heads", lambda m: m["model"]["layer_kv_heads"].__setitem__(1, 3),
     ["multiple of its 3 kv heads"]),
    ("one head dim too few", lambda m: m["model"]["layer_head_dim"].pop(), ["layer_head_dim"]),
    ("values from keys dropped", lambda m: m["model"].update(values_from_keys=False),
     ["tensor 'layers.1.attn.v'", "is missing"]),
    ("the per-layer inputs dropped", lambda m: m["model"].update(per_layer_input=0),
     ["'layers.0.per_layer.gate'", "is not one this model has"]),
    ("a proportional rope rotating nothing", lambda m: m["model"]["full_attention_rope"].update(partial_rotary_factor=0.0),
     ["model.full_attention_rope.partial_rotary_factor must be in (0, 1]"]),
    ("a negative soft cap", lambda m: m["model"].update(final_logit_softcap=-30.0), ["model.final_logit_softcap must be >= 0"]),
    ("an embedding scale of zero", lambda m: m["model"].update(embed_scale=0.0), ["model.embed_scale must be > 0"]),
    ("the post norms as a number", lambda m: m["model"].update(post_norms=1), ["model.post_norms must be true or false"]),
    ("an unknown gate activation", lambda m: m["model"].update(hidden_act="relu"), ["hidden_act"]),
]


@pytest.mark.parametrize("mutate, fragments", [c[1:] for c in MANIFEST_CORRUPTIONS], ids=[c[0] for c in MANIFEST_CORRUPTIONS])
def test_a_corrupt_gemma4_manifest_is_refused_naming_what(mutate, fragments, packs, tmp_path):
    from tests.pack.conftest import assert_refused_after

    pack = shutil.copytree(packs.pack(SPECS[0], "q8_0"), tmp_path / "pack")
    assert_refused_after(pack, mutate, fragments)


def test_the_step_by_step_expert_path_computes_what_the_fused_one_does(packs):
    """Experts whose parts differ in type (never written by the converter) run one at a time in
    numpy glue (moe._expert_ffn): the same GeGLU as col_moe_experts_ffn."""
    from colibrid import native
    from colibrid.engine.experts.source import PreadExpertSource
    from colibrid.engine.forward.moe import _expert_ffn
    from colibrid.pack import Pack

    pack = Pack.open(packs.pack(SPECS[0], "f32"))
    config, expert = pack.manifest.model, PreadExpertSource(pack).get(1, 2)
    x = np.random.default_rng(3).standard_normal((5, config.hidden_size)).astype(np.float32)
    fused = np.zeros_like(x)
    native.moe_experts_of([expert.kernel_buffers], x, np.zeros((5, 1), np.int32), np.ones((5, 1), np.float32), fused,
                          activation=config.expert_activation)
    np.testing.assert_allclose(_expert_ffn(config, x, expert), fused, rtol=0, atol=1e-6 * np.abs(fused).max())
