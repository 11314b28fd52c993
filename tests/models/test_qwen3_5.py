"""Qwen3.5-MoE / Qwen3.6 (qwen3_5_moe) and Qwen3-Next (qwen3_next) are the same models as
transformers' Qwen3_5MoeForCausalLM / Qwen3NextForCausalLM: Gated DeltaNet layers (chunked
prefill over a prompt longer than one chunk, then token by token, more value heads than key
heads, conv kernel 4) between gated full-attention layers (output gate, per-head q/k norm,
partial rotary), zero-centred norms, a sigmoid-gated shared expert; converted from the
published multimodal layout (text_config, model.language_model.*, a vision tower, experts
fused per layer, MTP weights) as from a text checkpoint. Text-only mRoPE is plain RoPE."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest

from colibrid.models import architecture_for
from tests.tiny_checkpoints import CheckpointSpec, assert_same_model, load_reference, random_prompt

SPECS = [
    # three DeltaNet layers, then a full-attention one; partial rotary 0.25 (4 of 16 dims)
    CheckpointSpec("qwen3_5_moe"),
    # alternating layers, partial rotary 0.5, a tied head, a bf16 source
    CheckpointSpec("qwen3_5_moe", {"layer_types": ["linear_attention", "full_attention"] * 2, "tie_word_embeddings": True,
                                   "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                       "partial_rotary_factor": 0.5}}, dtype="bfloat16"),
    # Qwen3-Next's fused in_proj_qkvz / in_proj_ba, a dense MLP layer, no renormalisation
    CheckpointSpec("qwen3_next", {"mlp_only_layers": [1], "norm_topk_prob": False}),
]
PUBLISHED = CheckpointSpec("qwen3_5_moe_vl")  # the multimodal wrapper Qwen publishes

PROMPT_TOKENS = 80  # longer than one 64-token chunk of the DeltaNet prefill


def _prompt(vocab_size: int) -> list[int]:
    return random_prompt(vocab_size, PROMPT_TOKENS)


def _assert_matches_transformers(checkpoint, pack) -> None:
    from colibrid.engine import load

    engine = load(pack)
    assert_same_model(load_reference(checkpoint), engine, _prompt(engine.config.vocab_size))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_logits_and_greedy_match_transformers(spec, packs):
    _assert_matches_transformers(packs.checkpoint(spec), packs.pack(spec, "f32"))


def test_specs_exercise_the_features_they_claim(packs):
    from colibrid.pack import Pack

    packs_ = [Pack.open(packs.pack(spec, "f32")) for spec in SPECS]
    configs = [p.manifest.model for p in packs_]
    assert [c.architecture for c in configs] == ["qwen3_5_moe", "qwen3_5_moe", "qwen3_next"]
    assert [c.layer_mixers for c in configs] == [("deltanet",) * 3 + ("attention",),
                                                 ("deltanet", "attention") * 2, ("deltanet",) * 3 + ("attention",)]
    assert all(c.deltanet.num_value_heads > c.deltanet.num_key_heads and c.deltanet.conv_kernel == 4 for c in configs)
    assert all(c.qk_norm == "head" for c in configs)
    assert all(p.manifest.optional_tensors == {"attention_output_gate", "shared_expert_gated"} for p in packs_)
    assert [c.rotary_dim for c in configs] == [4, 8, 4]
    assert [c.norm_topk_prob for c in configs] == [True, True, False]
    assert [c.moe_layers for c in configs] == [(True,) * 4, (True,) * 4, (True, False, True, True)]
    assert [c.tie_word_embeddings for c in configs] == [False, True, False]
    # the zero-centred norms were randomised around 0 by transformers' (1 + w) and stored as 1 + w
    norms = np.asarray(packs_[0].dense("layers.3.attn.q_norm").data)
    assert np.abs(norms - 1).max() > 0.5


def test_published_layout_converts_and_matches_transformers(packs, tmp_path, caplog):
    """Qwen's layout: config.json of the multimodal model with the text model's under
    text_config, its weights under model.language_model., a vision tower, each layer's experts
    fused (gate_up_proj (E, 2F, D), down_proj (E, D, F)) and the MTP weights (mtp.*)."""
    from safetensors.numpy import load_file, save_file

    from colibrid.tools.convert.converter import convert
    from colibrid.tools.convert.quant_spec import parse_quant
    from colibrid.pack import Pack

    ckpt = shutil.copytree(packs.checkpoint(PUBLISHED), tmp_path / "published")
    tensors = load_file(ckpt / "model.safetensors")
    assert any(name.startswith("model.visual.") for name in tensors)
    config = json.loads((ckpt / "config.json").read_text())
    text = config["text_config"]
    for layer in range(text["num_hidden_layers"]):
        prefix = f"model.language_model.layers.{layer}.mlp.experts."
        experts = range(text["num_experts"])
        gate_up = [np.concatenate([tensors.pop(f"{prefix}{e}.gate_proj.weight"), tensors.pop(f"{prefix}{e}.up_proj.weight")])
                   for e in experts]
        tensors[prefix + "gate_up_proj"] = np.stack(gate_up)
        tensors[prefix + "down_proj"] = np.stack([tensors.pop(f"{prefix}{e}.down_proj.weight") for e in experts])
    tensors["mtp.fc.weight"] = np.ones((64, 128), np.float32)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    config["text_config"]["mtp_num_hidden_layers"] = 1
    (ckpt / "config.json").write_text(json.dumps(config))

    with caplog.at_level(logging.WARNING, logger="colibrid.tools.convert.converter"):
        convert(ckpt, tmp_path / "pack", parse_quant("f32"), progress=False)
    assert "qwen3_5_moe: converting its qwen3_5_moe text model (text_config); the vision tower" in caplog.text
    assert "skipping the 1 multi-token-prediction layer(s) (mtp.*)" in caplog.text
    manifest = Pack.open(tmp_path / "pack").manifest
    assert manifest.source["wrapper_model_type"] == "qwen3_5_moe" and manifest.model.architecture == "qwen3_5_moe"
    _assert_matches_transformers(ckpt, tmp_path / "pack")


def test_decode_with_state_equals_a_full_forward(packs):
    """Prefill in one step, then one token at a time through each layer's state (DeltaNet conv
    and recurrent states, the attention layer's KV cache): the logits of the full forward."""
    from colibrid.engine import load

    from colibrid import native
    from colibrid.engine.forward.deltanet import DeltaNet

    engine = load(packs.pack(SPECS[0], "f32"))
    mixers = [layer.mixer for layer in engine.model.layers if isinstance(layer.mixer, DeltaNet)]
    assert len(mixers) == 3 and all((m.fused is not None) == hasattr(native, "deltanet_block") for m in mixers)
    ids = _prompt(engine.config.vocab_size)
    full = engine.forward(ids)
    session = engine.new_session()
    split = PROMPT_TOKENS - 12
    stepped = [session.forward(ids[:split])] + [session.forward([token]) for token in ids[split:]]
    stepped = np.concatenate(stepped)
    assert np.abs(stepped - full).max() <= 1e-4 * np.abs(full).max()
    assert session.n_past == PROMPT_TOKENS


def test_fused_gated_attention_gives_the_logits_of_the_numpy_path(packs):
    """The full-attention layers' libcolibri step (output gate included) against the numpy path."""
    from colibrid.engine.forward.attention import Attention
    from colibrid.engine.engine import Engine
    from colibrid.pack import Pack

    fused, stepwise = (Engine(Pack.open(packs.pack(SPECS[1], "f32"))) for _ in range(2))
    attention = [layer.mixer for layer in stepwise.model.layers if isinstance(layer.mixer, Attention)]
    assert len(attention) == 2 and all(a.fused is not None and "gate" in a.w for a in attention)
    for a in attention:
        a.fused = None
    ids = _prompt(fused.config.vocab_size)
    a, b = fused.forward(ids), stepwise.forward(ids)
    assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()


def test_text_mrope_is_plain_rope_on_the_rotated_dims():
    """Qwen3.5's rotary embedding interleaves three sections (time, height, width) of the
    frequencies; for text the three position rows are equal, so its cos/sin are plain RoPE's
    over the rotated dims, which is what the engine computes. With differing rows they are not."""
    import torch
    import transformers

    from colibrid.engine.forward.rope import Rotary

    hf = transformers.Qwen3_5MoeTextConfig(hidden_size=64, num_attention_heads=4, head_dim=64,
                                           rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                            "partial_rotary_factor": 0.25, "mrope_section": [3, 3, 2],
                                                            "mrope_interleaved": True})
    config = architecture_for(hf.to_dict()).model_config(hf.to_dict())
    assert config.rotary_dim == 16 and config.rope.theta == 1e7
    reference = transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeTextRotaryEmbedding(hf)
    positions = np.arange(300, dtype=np.int64)
    text_rows = torch.from_numpy(positions)[None, None].expand(3, 1, -1)
    cos, sin = reference(torch.zeros(1), text_rows)
    ours = Rotary(config.rope, config.rotated_dims).cos_sin(positions)
    np.testing.assert_allclose(ours[0], cos[0].numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(ours[1], sin[0].numpy(), rtol=0, atol=1e-6)
    image_rows = torch.stack([text_rows[0], text_rows[1] // 2, text_rows[2] % 7])  # an image's grid positions
    cos_image, _ = reference(torch.zeros(1), image_rows)
    assert np.abs(cos_image[0].numpy() - ours[0]).max() > 0.1


# the shape of Qwen/Qwen3.6-35B-A3B's config.json (its text_config; the keys Colibri reads and a few it does not)
QWEN36_35B = {
    "model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"], "tie_word_embeddings": False,
    "vision_config": {"depth": 27, "hidden_size": 1152, "model_type": "qwen3_5_moe"},
    "text_config": {
        "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256,
        "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "vocab_size": 248320, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "full_attention_interval": 4,
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10, "mtp_num_hidden_layers": 1,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                            "rope_theta": 10000000, "partial_rotary_factor": 0.25},
        "attention_bias": False, "hidden_act": "silu", "eos_token_id": 248044},
}
# the shape of Qwen/Qwen3-Next-80B-A3B-Instruct's config.json
QWEN3_NEXT_80B = {
    "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "hidden_size": 2048, "intermediate_size": 5120,
    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "full_attention_interval": 4, "rope_theta": 10000000, "partial_rotary_factor": 0.25, "vocab_size": 151936,
    "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu",
    "eos_token_id": 151645,
}


def test_published_qwen36_config():
    from colibrid.tools.convert.converter import Converter
    from colibrid.tools.convert.wrapped import text_model_config

    text = text_model_config(QWEN36_35B, Converter._is_supported)
    assert text.wrapper == "qwen3_5_moe"
    arch = architecture_for(text.config)
    c = arch.model_config(text.config)
    assert c.architecture == "qwen3_5_moe" and c.layer_mixers == (("deltanet",) * 3 + ("attention",)) * 10
    assert (c.head_dim, c.rotary_dim, c.rope.theta, c.rope.type) == (256, 64, 1e7, "default")
    assert c.deltanet.conv_channels == 2 * 16 * 128 + 32 * 128 and c.deltanet.num_value_heads == 32
    assert (c.num_experts, c.num_experts_per_tok, c.expert_ffn, c.shared_expert_ffn) == (256, 8, 512, 512)
    optional = arch.optional_tensors(text.config)
    assert c.norm_topk_prob and optional == {"attention_output_gate", "shared_expert_gated"} and all(c.moe_layers)
    names = arch.dense_tensor_names(c, optional)
    assert names["layers.0.attn.qkv"] == "model.layers.0.linear_attn.in_proj_qkv.weight"
    assert names["layers.3.attn.gate"].rows[:2] == (256, 257) and len(names["layers.3.attn.gate"].rows) == 16 * 256
    assert "layers.0.attn.q" not in names and "layers.3.attn.qkv" not in names
    assert "layers.39.attn.q_norm" in set(arch.zero_centred_norms(c)) and "layers.0.attn.norm" not in set(
        arch.zero_centred_norms(c))
    assert arch.conversion_notes(text.config) == [
        "qwen3_5_moe: skipping the 1 multi-token-prediction layer(s) (mtp.*): Colibri predicts one token per step"]


def test_published_qwen3_next_config():
    from colibrid.models.qwen3_next import fused_projection_rows

    arch = architecture_for(QWEN3_NEXT_80B)
    c = arch.model_config(QWEN3_NEXT_80B)
    assert c.architecture == "qwen3_next" and c.layer_mixers == (("deltanet",) * 3 + ("attention",)) * 12
    assert (c.num_experts, c.num_experts_per_tok, c.rotary_dim, c.dense_ffn) == (512, 10, 64, 5120)
    rows = fused_projection_rows(c)
    # each of the 16 key-head groups: q 128, k 128, v 2 x 128, z 2 x 128 rows
    assert rows["qkv"][:2] == (0, 1) and rows["qkv"][128] == 768 and rows["qkv"][2048] == 128
    assert rows["qkv"][4096] == 256 and rows["z"][0] == 512 and len(rows["z"]) == 32 * 128
    assert rows["b"][:3] == (0, 1, 4) and rows["a"][:3] == (2, 3, 6)
    assert sorted(rows["qkv"] + rows["z"]) == list(range(2 * 16 * 128 + 2 * 32 * 128))


def test_hybrid_model_state_is_small():
    """A Qwen3.6-35B-A3B sequence: each of the 30 DeltaNet layers keeps 2.2 MB whatever the
    context (conv inputs 3 x 8192 floats, recurrent state 32 x 128 x 128); only the 10
    full-attention layers grow, by 2 kv heads x 256 dims x (k, v) per token."""
    from colibrid.engine.forward.deltanet import DeltaNetState

    c = architecture_for(QWEN36_35B["text_config"]).model_config(QWEN36_35B["text_config"])
    assert DeltaNetState(c.deltanet).nbytes == 4 * (3 * 8192 + 32 * 128 * 128) == 2_195_456
    assert c.layer_mixers.count("deltanet") == 30 and c.num_kv_heads * c.head_dim * 2 * 4 == 4096


def test_unsupported_options_are_refused():
    from colibrid.models import UnsupportedConfig

    text = QWEN36_35B["text_config"]
    for bad, match in (({"attention_bias": True}, "attention_bias"), ({"linear_num_value_heads": 24}, "multiple"),
                       ({"layer_types": ["sliding_attention"] * 40}, "layer_types")):
        with pytest.raises(UnsupportedConfig, match=match):
            architecture_for(text).model_config({**text, **bad})
