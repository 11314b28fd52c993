"""DeepSeek-V3 (deepseek_v3, also Kimi K2) and DeepSeek-V2 (deepseek_v2) are the same models
as transformers' DeepseekV3ForCausalLM / DeepseekV2ForCausalLM: multi-head latent attention
with q's low-rank path on and off, interleaved and rotate-half RoPE, YaRN with its mscale in
the softmax scale; sigmoid routing with a choice bias and groups scored by their best two
(V3), softmax routing greedy or group-limited (V2); shared experts, a dense first layer.
The latent cache gives the logits of the expanded form, at a fraction of its size; the
published configs read as their models are."""

from __future__ import annotations

import json

import numpy as np
import pytest

from colibrid.models import architecture_for
from tests.tiny_checkpoints import CheckpointSpec, assert_same_model, load_reference, random_prompt

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 10000.0,
        "beta_fast": 32, "beta_slow": 1}
SPECS = [
    # q_lora 64, interleaved rope pairs, YaRN with mscale != mscale_all_dim, 4 groups of 2 keeping 2, scaling 2.5
    CheckpointSpec("deepseek_v3", {"num_hidden_layers": 3, "rope_parameters": {**YARN, "mscale": 0.707,
                                                                               "mscale_all_dim": 1.0}}),
    # one q_proj (q_lora_rank null), rotate-half rope, no renormalisation, two shared experts' width,
    # one group, tied head, a bf16 source
    CheckpointSpec("deepseek_v3", {"q_lora_rank": None, "rope_interleave": False, "norm_topk_prob": False,
                                   "n_shared_experts": 2, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
                                   "tie_word_embeddings": True}, dtype="bfloat16"),
    # DeepSeek-V2-Lite's shape: one q_proj, greedy softmax routing, YaRN with mscale = mscale_all_dim
    CheckpointSpec("deepseek_v2", {"q_lora_rank": None, "topk_method": "greedy",
                                   "rope_parameters": {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707}}),
    # DeepSeek-V2's: q_lora, group_limited_greedy over 4 groups keeping 2, scaling 1.5
    CheckpointSpec("deepseek_v2", {"num_hidden_layers": 3, "topk_method": "group_limited_greedy",
                                   "routed_scaling_factor": 1.5}),
]

PROMPT_TOKENS = 32


def _prompt(vocab_size: int) -> list[int]:
    return random_prompt(vocab_size, PROMPT_TOKENS)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_logits_and_greedy_match_transformers(spec, packs):
    from colibrid.engine import load

    engine = load(packs.pack(spec, "f32"))
    assert_same_model(load_reference(packs.checkpoint(spec)), engine, _prompt(engine.config.vocab_size))


def test_specs_exercise_the_features_they_claim(packs):
    from colibrid.pack import Pack

    packs_ = [Pack.open(packs.pack(spec, "f32")) for spec in SPECS]
    configs = [p.manifest.model for p in packs_]
    assert [c.architecture for c in configs] == ["deepseek_v3", "deepseek_v3", "deepseek_v2", "deepseek_v2"]
    assert all(c.mla is not None and c.mla.kv_lora_rank == 64 and c.head_dim == 48 for c in configs)
    assert [c.mla.q_lora_rank for c in configs] == [64, 0, 0, 64]
    assert [c.mla.rope_interleaved for c in configs] == [True, False, True, True]
    assert [c.router_scoring for c in configs] == ["sigmoid", "sigmoid", "softmax", "softmax"]
    assert [c.router_groups_kept < c.router_groups for c in configs] == [True, False, False, True]
    assert [c.router_group_score for c in configs] == ["top2_sum", "top2_sum", "max", "max"]
    assert [c.norm_topk_prob for c in configs] == [True, False, False, False]
    assert [c.routed_scaling_factor for c in configs] == [2.5, 1.0, 1.0, 1.5]
    assert [c.shared_expert_ffn for c in configs] == [64, 128, 64, 64]
    assert all(c.moe_layers[0] is False and all(c.moe_layers[1:]) for c in configs)
    yarn = [c for c in configs if c.rope.type == "yarn"]
    assert len(yarn) == 2 and all(c.mla.softmax_scale != 48 ** -0.5 for c in yarn)
    assert yarn[0].rope.attention_factor != 1.0 and yarn[1].rope.attention_factor == 1.0  # mscale / mscale_all_dim
    for pack, config in zip(packs_[:2], configs[:2]):  # the choice bias was randomised, so it is exercised
        for layer in config.moe_layer_ids:
            assert np.abs(np.asarray(pack.dense(f"layers.{layer}.router_choice_bias").data)).max() > 0.01


@pytest.mark.parametrize("spec", [SPECS[0], SPECS[2]], ids=lambda s: s.name)
def test_latent_cache_gives_the_logits_of_the_expanded_form(spec, packs):
    """The same pack run twice: the libcolibri absorbed form over the latent cache, and the
    numpy expanded form (per-head keys and values rebuilt from the cached latents at every
    step, as transformers computes them); prompt, then 8 decode steps."""
    from colibrid.engine.engine import Engine
    from colibrid.engine.forward.kv_cache import LatentCache
    from colibrid.pack import Pack

    latent, expanded = Engine(Pack.open(packs.pack(spec, "f32"))), Engine(Pack.open(packs.pack(spec, "f32")))
    for layer in expanded.model.layers:
        assert layer.mixer.fused is not None
        layer.mixer.fused = None  # the numpy expanded form
    ids = _prompt(latent.config.vocab_size)
    sessions = latent.new_session(), expanded.new_session()
    assert all(isinstance(state, LatentCache) for s in sessions for state in s.state.layers)
    step = ids
    for _ in range(9):
        a, b = (s.forward(step) for s in sessions)
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()
        step = [int(a[-1].argmax())]
    assert sessions[0].n_past == sessions[1].n_past == PROMPT_TOKENS + 8


# config.json of deepseek-ai/DeepSeek-V3 as published (the keys Colibri reads and a few it does not)
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu",
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000, "attention_bias": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "tie_word_embeddings": False, "vocab_size": 129280, "num_nextn_predict_layers": 1, "bos_token_id": 0,
    "eos_token_id": 1,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}
# deepseek-ai/DeepSeek-V2-Lite's
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
    "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64, "routed_scaling_factor": 1.0,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "greedy", "n_group": 1, "topk_group": 1, "num_experts_per_tok": 6, "moe_layer_freq": 1,
    "first_k_dense_replace": 1, "norm_topk_prob": False, "scoring_func": "softmax", "hidden_act": "silu",
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000, "attention_bias": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "tie_word_embeddings": False, "vocab_size": 102400, "bos_token_id": 100000, "eos_token_id": 100001,
}


def _mscale(factor, m):
    return 0.1 * m * np.log(factor) + 1.0


def test_published_deepseek_v3_config():
    arch = architecture_for(DEEPSEEK_V3)
    c = arch.model_config(DEEPSEEK_V3)
    m = c.mla
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (1536, 512, 128, 64, 128)
    assert (c.head_dim, c.num_heads, c.num_kv_heads, c.rotated_dims, m.rope_interleaved) == (192, 128, 128, 64, True)
    assert m.softmax_scale == pytest.approx(192 ** -0.5 * _mscale(40, 1.0) ** 2)
    assert (c.rope.type, c.rope.factor, c.rope.attention_factor) == ("yarn", 40.0, 1.0)
    assert c.moe_layers == (False,) * 3 + (True,) * 58 and c.dense_ffn == 18432
    assert (c.num_experts, c.num_experts_per_tok, c.expert_ffn, c.shared_expert_ffn) == (256, 8, 2048, 2048)
    assert (c.router_scoring, c.router_groups, c.router_groups_kept, c.router_group_score) == ("sigmoid", 8, 4, "top2_sum")
    assert arch.optional_tensors(DEEPSEEK_V3) == {"router_choice_bias"}
    assert c.norm_topk_prob and c.routed_scaling_factor == 2.5
    names = arch.dense_tensor_names(c, arch.optional_tensors(DEEPSEEK_V3))
    assert names["layers.3.router_choice_bias"] == "model.layers.3.mlp.gate.e_score_correction_bias"
    assert names["layers.3.attn.q_b"] == "model.layers.3.self_attn.q_b_proj.weight"
    assert names["layers.0.attn.kv_a"] == "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert "layers.0.attn.q" not in names and "layers.0.attn.k" not in names
    assert not any(name.startswith("model.layers.61.") for name in names.values())  # the MTP layer
    assert arch.conversion_notes(DEEPSEEK_V3) == [
        "deepseek_v3: skipping 1 multi-token-prediction layer(s) (model.layers.61): Colibri predicts one token per step"]


def test_kimi_k2_reads_as_deepseek_v3():
    kimi = {**DEEPSEEK_V3, "model_type": "kimi_k2", "num_attention_heads": 64, "n_routed_experts": 384, "n_group": 1,
            "topk_group": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.827, "vocab_size": 163840,
            "rope_theta": 50000.0, "rope_scaling": {**DEEPSEEK_V3["rope_scaling"], "factor": 32, "beta_fast": 1}}
    arch = architecture_for(kimi)
    c = arch.model_config(kimi)
    assert arch.name == "deepseek_v3" and c.num_experts == 384 and c.router_groups == 1 and c.mla.q_lora_rank == 1536


def test_published_deepseek_v2_lite_config():
    c = architecture_for(DEEPSEEK_V2_LITE).model_config(DEEPSEEK_V2_LITE)
    assert c.architecture == "deepseek_v2" and c.mla.q_lora_rank == 0 and c.mla.rope_interleaved
    assert (c.router_scoring, c.router_groups, c.norm_topk_prob) == ("softmax", 1, False)
    assert c.mla.softmax_scale == pytest.approx(192 ** -0.5 * _mscale(40, 0.707) ** 2)
    assert (c.num_experts, c.num_experts_per_tok, c.shared_expert_ffn) == (64, 6, 2816)
    assert c.moe_layers[0] is False and all(c.moe_layers[1:])


def test_latent_cache_is_one_57th_of_a_full_cache_for_deepseek_v3():
    """Per token and layer, V3 caches 512 + 64 = 576 floats. Expanded per-head keys (128 nope + 64
    rope) and values (128) would be 128 x 320 = 40960 (71.1 x); the full cache of a plain
    128-head attention with 128-dim heads, 128 x 2 x 128 = 32768 (56.9 x, the ratio usually quoted)."""
    from colibrid.engine.forward.kv_cache import KVCache, LatentCache

    c = architecture_for(DEEPSEEK_V3).model_config(DEEPSEEK_V3)
    tokens = 256
    cache = LatentCache(c.mla.kv_lora_rank + c.mla.qk_rope_head_dim, tokens)  # as LatentAttention.new_state makes it
    per_token = cache.nbytes // tokens
    assert per_token == 576 * 4
    expanded = c.num_heads * (c.head_dim + c.mla.v_head_dim) * 4
    assert expanded / per_token == pytest.approx(71.11, abs=0.01)
    assert 128 * 2 * 128 * 4 / per_token == pytest.approx(56.89, abs=0.01)
    assert KVCache(128, 128, tokens).nbytes // tokens / per_token == pytest.approx(56.89, abs=0.01)


def test_unsupported_deepseek_options_are_refused():
    from colibrid.models import UnsupportedConfig

    for bad, match in (({"topk_method": "noaux_tc"}, "topk_method"), ({"attention_bias": True}, "attention_bias"),
                       ({"scoring_func": "sigmoid"}, "scoring_func")):
        with pytest.raises(UnsupportedConfig, match=match):
            architecture_for(DEEPSEEK_V2_LITE).model_config({**DEEPSEEK_V2_LITE, **bad})


def test_fp8_checkpoint_as_published_converts_and_matches_transformers(packs, tmp_path):
    """DeepSeek-V3's published layout: every projection (latent attention, experts, shared
    expert, dense MLP) float8_e4m3 with 128x128-style block scales (here 48x40, so edges are
    partial), routers, norms and embeddings not, in two shards with an index. The pack holds
    the decoded values exactly and generates as transformers does on them."""
    from safetensors.numpy import load_file, save_file

    from colibrid.tools.convert.converter import convert
    from colibrid.tools.convert.quant_spec import parse_quant
    from colibrid.engine import load
    from colibrid.pack import Pack
    from tests.tools.convert.test_published_quantized import oracle_fp8, random_e4m3, write_safetensors

    block = (48, 40)
    source = packs.checkpoint(SPECS[0])
    state = load_file(source / "model.safetensors")
    quantized, decoded = {}, {}
    for i, (name, array) in enumerate(sorted(state.items())):
        if name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight"):
            codes = random_e4m3(array.shape, 200 + i)
            grid = (-(-array.shape[0] // block[0]), -(-array.shape[1] // block[1]))
            scale = np.random.default_rng(i).uniform(2e-4, 1e-3, grid).astype(np.float32)
            quantized[name], quantized[name + "_scale_inv"] = ("F8_E4M3", codes), ("F32", scale)
            decoded[name] = oracle_fp8(codes, scale, block)
        else:
            quantized[name], decoded[name] = ("F32", array), array
    assert "model.layers.1.self_attn.kv_b_proj.weight_scale_inv" in quantized
    published, reference_dir = tmp_path / "published", tmp_path / "decoded"
    for directory in (published, reference_dir):
        directory.mkdir()
        for f in source.iterdir():
            if f.name != "model.safetensors":
                (directory / f.name).write_bytes(f.read_bytes())
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}
    (published / "config.json").write_text(json.dumps(config))
    names = sorted(quantized)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, shard_names in shards.items():
        write_safetensors(published / shard, {n: quantized[n] for n in shard_names})
    weight_map = {n: shard for shard, shard_names in shards.items() for n in shard_names}
    (published / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    save_file({k: np.ascontiguousarray(v) for k, v in decoded.items()}, str(reference_dir / "model.safetensors"),
              metadata={"format": "pt"})

    out = tmp_path / "pack"
    convert(published, out, parse_quant("f32"), progress=False)
    pack = Pack.open(out)
    np.testing.assert_array_equal(pack.dense("layers.1.attn.kv_b").data, decoded["model.layers.1.self_attn.kv_b_proj.weight"])
    engine = load(out)
    assert_same_model(load_reference(reference_dir), engine, _prompt(engine.config.vocab_size))
