"""GLM-4.5 (glm4_moe) is the same model as transformers' Glm4MoeForCausalLM: sigmoid routing
with a choice-only bias, group limits and a scaling factor, an ungated shared expert, a
dense first layer, partial rotary, q/k norm on and off, attention biases; read from both the
transformers-5 config.json and the published one; MTP layers skipped with a note."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest

from colibrid.models import architecture_for
from tests.tiny_checkpoints import CheckpointSpec, assert_same_model, load_reference, random_prompt

SPECS = [
    # partial rotary 0.5 (the default: 8 of 16 dims), qk-norm, q/k/v biases, 4 groups of 2 keeping 2, scaling 2.5
    CheckpointSpec("glm4_moe", {"num_hidden_layers": 3, "use_qk_norm": True, "attention_bias": True, "n_group": 4,
                                "topk_group": 2, "routed_scaling_factor": 2.5}),
    # partial rotary 0.25 (4 of 16 dims), no qk-norm, no biases, one group, no renormalisation,
    # two shared experts' width, tied head, a bf16 source
    CheckpointSpec("glm4_moe", {"use_qk_norm": False, "norm_topk_prob": False, "n_shared_experts": 2,
                                "tie_word_embeddings": True,
                                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                    "partial_rotary_factor": 0.25}}, dtype="bfloat16"),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_logits_and_greedy_match_transformers(spec, packs):
    from colibrid.engine import load

    engine = load(packs.pack(spec, "f32"))
    assert_same_model(load_reference(packs.checkpoint(spec)), engine, random_prompt(engine.config.vocab_size))


def test_specs_exercise_the_features_they_claim(packs):
    from colibrid.pack import Pack

    packs_ = [Pack.open(packs.pack(spec, "f32")) for spec in SPECS]
    configs = [p.manifest.model for p in packs_]
    optional = [p.manifest.optional_tensors for p in packs_]
    assert all(c.architecture == "glm4_moe" and c.router_scoring == "sigmoid" for c in configs)
    assert optional == [{"router_choice_bias", "qkv_bias"}, {"router_choice_bias"}]
    assert {c.rotary_dim for c in configs} == {8, 4} and all(c.head_dim == 16 for c in configs)
    assert {c.qk_norm for c in configs} == {"head", "none"}
    assert any(c.router_groups_kept < c.router_groups for c in configs)
    assert {c.routed_scaling_factor for c in configs} == {2.5, 1.0} and {c.norm_topk_prob for c in configs} == {True, False}
    assert {c.shared_expert_ffn for c in configs} == {64, 128} and not any("shared_expert_gated" in o for o in optional)
    assert all(c.moe_layers[0] is False and all(c.moe_layers[1:]) for c in configs)
    for pack, config in zip(packs_, configs):  # the choice bias was randomised, so it is exercised
        for layer in config.moe_layer_ids:
            assert np.abs(np.asarray(pack.dense(f"layers.{layer}.router_choice_bias").data)).max() > 0.01


GLM_45_AIR_STYLE = {  # the shape of zai-org/GLM-4.5-Air's config.json (smaller numbers)
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True, "head_dim": 32,
    "hidden_act": "silu", "hidden_size": 64, "partial_rotary_factor": 0.5, "intermediate_size": 160,
    "max_position_embeddings": 131072, "moe_intermediate_size": 32, "norm_topk_prob": True, "num_attention_heads": 6,
    "n_group": 1, "topk_group": 1, "n_routed_experts": 16, "n_shared_experts": 1, "routed_scaling_factor": 1.0,
    "num_experts_per_tok": 4, "first_k_dense_replace": 1, "num_hidden_layers": 4, "num_key_value_heads": 2,
    "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000,
    "tie_word_embeddings": False, "use_qk_norm": False, "vocab_size": 1000, "eos_token_id": [7, 8, 9],
}


def test_published_glm_45_air_config():
    arch = architecture_for(GLM_45_AIR_STYLE)
    c, optional = arch.model_config(GLM_45_AIR_STYLE), arch.optional_tensors(GLM_45_AIR_STYLE)
    assert (c.head_dim, c.rotary_dim, c.rope.theta) == (32, 16, 1e6)  # head_dim apart from hidden / heads
    assert optional == {"qkv_bias", "router_choice_bias"} and c.qk_norm == "none"  # q/k/v biases, none on o
    assert c.moe_layers == (False, True, True, True) and c.dense_ffn == 160
    assert (c.num_experts, c.num_experts_per_tok, c.expert_ffn, c.shared_expert_ffn) == (16, 4, 32, 32)
    assert (c.router_groups, c.router_groups_kept, c.routed_scaling_factor) == (1, 1, 1.0)
    assert c.eos_token_ids == (7, 8, 9)
    names = arch.dense_tensor_names(c, optional)
    assert names["layers.1.router_choice_bias"] == "model.layers.1.mlp.gate.e_score_correction_bias"
    assert names["layers.1.shared.down"] == "model.layers.1.mlp.shared_experts.down_proj.weight"
    assert names["layers.0.mlp.gate"] == "model.layers.0.mlp.gate_proj.weight"
    assert not any(name.startswith("model.layers.4.") for name in names.values())  # the MTP layer
    assert arch.conversion_notes(GLM_45_AIR_STYLE) == [
        "glm4_moe: skipping 1 multi-token-prediction layer(s) (model.layers.4): Colibri predicts one token per step"]


def test_partial_rotary_defaults_to_half_as_transformers():
    hf = {k: v for k, v in GLM_45_AIR_STYLE.items() if k != "partial_rotary_factor"}
    assert architecture_for(hf).model_config(hf).rotary_dim == 16


def test_other_families_still_refuse_partial_rotary():
    from colibrid.models import UnsupportedConfig

    hf = {"model_type": "qwen3_moe", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "partial_rotary_factor": 0.5}
    with pytest.raises(UnsupportedConfig, match="partial_rotary_factor"):
        architecture_for(hf).model_config(hf)


def test_mtp_layers_are_skipped_with_a_note(packs, tmp_path, caplog):
    """A checkpoint as published: an extra layer past num_hidden_layers (the MTP module)."""
    from safetensors.numpy import load_file, save_file

    from colibrid.tools.convert.converter import convert
    from colibrid.tools.convert.quant_spec import parse_quant
    from colibrid.pack import Pack

    ckpt = shutil.copytree(packs.checkpoint(SPECS[0]), tmp_path / "ckpt")
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = np.ones((64, 128), np.float32)
    tensors["model.layers.3.mlp.experts.0.up_proj.weight"] = np.ones((64, 64), np.float32)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    assert json.loads((ckpt / "config.json").read_text())["num_nextn_predict_layers"] == 1
    with caplog.at_level(logging.WARNING, logger="colibrid.tools.convert.converter"):
        convert(ckpt, tmp_path / "out", parse_quant("f32"), progress=False)
    assert "skipping 1 multi-token-prediction layer(s) (model.layers.3)" in caplog.text
    manifest = Pack.open(tmp_path / "out").manifest
    assert not any(name.startswith("layers.3.") for name in manifest.dense_tensors)
    assert {row.layer for row in manifest.expert_records} == {1, 2}


def test_a_missing_tensor_is_refused_naming_the_family(packs, tmp_path):
    import subprocess
    import sys

    from safetensors.numpy import load_file, save_file

    ckpt = shutil.copytree(packs.checkpoint(SPECS[0]), tmp_path / "ckpt")
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.2.mlp.gate.e_score_correction_bias"]
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    result = subprocess.run([sys.executable, "-m", "colibrid.tools.convert.cli", str(ckpt), str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"colibri-convert: error: glm4_moe checkpoint {ckpt} lacks tensor model.layers.2.mlp.gate.e_score_correction_bias")
    assert not (tmp_path / "out").exists()
