"""gpt-oss (gpt_oss) is the same model as transformers' GptOssForCausalLM: per-head sinks,
sliding-window and full layers alternating with a window shorter than the prompt, q/k/v/o
biases, YaRN RoPE (truncate off, as published), the router bias with top-k then softmax,
experts with biases and the clamped SwiGLU, their gate and up interleaved in one fused
tensor; from value-dtype checkpoints (as transformers saves them) and from MXFP4 experts (as
OpenAI publishes them), read from the transformers-5 config.json and the published one."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from colibrid.models import architecture_for
from tests.pack.conftest import assert_refused_after
from tests.tiny_checkpoints import CheckpointSpec, assert_same_model, load_reference, random_prompt

SPECS = [
    # the default clamp (7) never bites at these magnitudes; sliding, full, sliding
    CheckpointSpec("gpt_oss", {"num_hidden_layers": 3}),
    # a clamp of 0.15 bites on most gate/up values; the alpha of transformers' config, a bf16 source,
    # full then sliding (layer_types given), a window of 6
    CheckpointSpec("gpt_oss", {"swiglu_limit": 0.15, "sliding_window": 6,
                               "layer_types": ["full_attention", "sliding_attention"]}, dtype="bfloat16"),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_logits_and_greedy_match_transformers(spec, packs):
    from colibrid.engine import load

    engine = load(packs.pack(spec, "f32"))
    assert_same_model(load_reference(packs.checkpoint(spec)), engine, random_prompt(engine.config.vocab_size))


def test_decode_over_the_window_equals_prefill(packs):
    """Decode steps past the sliding window (4) give the prefill's rows."""
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
    configs = [p.manifest.model for p in packs_]
    assert all(p.manifest.optional_tensors == {"attention_sinks", "qkv_bias", "o_bias", "router_bias", "expert_bias"}
               for p in packs_)
    assert all(c.architecture == "gpt_oss" for c in configs)
    assert configs[0].sliding_window == (4, None, 4) and configs[1].sliding_window == (None, 6)
    assert all(c.rope.type == "yarn" and c.rope.truncate is False and c.rope.factor == 32.0 for c in configs)
    assert all(c.router_scoring == "topk_softmax" and not c.norm_topk_prob for c in configs)
    assert all(c.expert_activation == "clamped_swiglu" and c.swiglu_alpha == 1.702 for c in configs)
    assert [c.swiglu_limit for c in configs] == [7.0, 0.15]
    for pack in packs_:
        assert list(pack.manifest.expert_parts) == ["gate", "up", "down", "gate_bias", "up_bias", "down_bias"]
        assert np.abs(np.asarray(pack.dense("layers.0.attn.sinks").data)).max() > 0.01
        assert np.abs(np.asarray(pack.dense("layers.0.router_bias").data)).max() > 0.01


def test_the_fused_gate_up_is_split_even_gate_odd_up(packs):
    """The pack's gate and up of expert 3 are the even and odd columns of transformers'
    (D, 2F) gate_up_proj, transposed; the biases follow the same split."""
    import torch

    from colibrid.engine.experts.source import PreadExpertSource
    from colibrid.pack import Pack

    spec = SPECS[0]
    reference = load_reference(packs.checkpoint(spec))
    experts = reference.model.layers[1].mlp.experts
    weights = PreadExpertSource(Pack.open(packs.pack(spec, "f32"))).get(1, 3)
    with torch.no_grad():
        gate_up, bias = experts.gate_up_proj[3].numpy(), experts.gate_up_proj_bias[3].numpy()  # (D, 2F), (2F)
        down, down_bias = experts.down_proj[3].numpy(), experts.down_proj_bias[3].numpy()  # (F, D), (D)
    np.testing.assert_array_equal(weights.gate.data, gate_up[:, 0::2].T)
    np.testing.assert_array_equal(weights.up.data, gate_up[:, 1::2].T)
    np.testing.assert_array_equal(weights.down.data, down.T)
    np.testing.assert_array_equal(weights.gate_bias.data, bias[0::2])
    np.testing.assert_array_equal(weights.up_bias.data, bias[1::2])
    np.testing.assert_array_equal(weights.down_bias.data, down_bias)


# --- published layout: MXFP4 experts ---------------------------------------------------------


def _published_mxfp4(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """values (..., R, C) float32 -> (blocks (..., R, C/32, 16), scales (..., R, C/32) uint8 as
    gpt-oss publishes them, the float32 values they decode to). Element 2k of a group in the
    low nibble of byte k, 2k + 1 in the high nibble (transformers' integrations/mxfp4.py)."""
    from colibrid import native

    *lead, R, C = values.shape
    rows = np.ascontiguousarray(values.reshape(-1, C), dtype=np.float32)
    packed = native.quantize(native.TensorType.MXFP4, rows).reshape(-1, C // 32, 17)  # the pack's block
    scales = packed[..., 0]
    codes = np.empty(packed.shape[:-1] + (32,), np.uint8)  # element order
    codes[..., :16], codes[..., 16:] = packed[..., 1:] & 0x0F, packed[..., 1:] >> 4
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    decoded = native.dequantize(native.TensorType.MXFP4, packed.reshape(rows.shape[0], -1), rows.shape[0], C)
    # contiguous copies: safetensors writes an array's memory as it lies, whatever its strides
    return (np.ascontiguousarray(blocks.reshape(*lead, R, C // 32, 16)),
            np.ascontiguousarray(scales.reshape(*lead, R, C // 32)), decoded.reshape(values.shape))


# As OpenAI publishes gpt-oss: bf16 attention, router, norms and embeddings, sharded with an index.
PUBLISHED_SPEC = CheckpointSpec("gpt_oss", {"num_hidden_layers": 3}, dtype="bfloat16", max_shard_size="150KB")


@pytest.fixture(scope="module")
def mxfp4_checkpoint(packs, tmp_path_factory):
    """PUBLISHED_SPEC with its experts as published: gate_up_proj (E, 2F, D) and down_proj
    (E, D, F) as *_blocks / *_scales (U8) in the shard that held them, the index updated,
    everything else as it was; and a transformers model holding the values those blocks
    decode to."""
    import torch
    from safetensors.torch import load_file, save_file

    ckpt = shutil.copytree(packs.checkpoint(PUBLISHED_SPEC), tmp_path_factory.mktemp("gpt_oss_mxfp4") / "ckpt")
    reference = load_reference(ckpt)
    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = {shard: load_file(ckpt / shard) for shard in sorted(set(index["weight_map"].values()))}
    assert len(shards) > 1
    for layer, block in enumerate(reference.model.layers):
        experts = block.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            full = f"model.layers.{layer}.mlp.experts.{name}"
            shard = index["weight_map"].pop(full)
            stored = shards[shard].pop(full).float().numpy()  # (E, in, out) as transformers saves it
            blocks, scales, decoded = _published_mxfp4(np.swapaxes(stored, -1, -2))  # groups along the input
            for suffix, part in (("_blocks", blocks), ("_scales", scales)):
                shards[shard][full + suffix] = torch.from_numpy(part)
                index["weight_map"][full + suffix] = shard
            with torch.no_grad():
                getattr(experts, name).copy_(torch.from_numpy(np.swapaxes(decoded, -1, -2).copy()))
    for shard, tensors in shards.items():
        save_file(tensors, ckpt / shard, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (ckpt / "config.json").write_text(json.dumps(config))
    return ckpt, reference


def test_mxfp4_experts_convert_losslessly(mxfp4_checkpoint, tmp_path):
    from colibrid.tools.convert.converter import convert
    from colibrid.tools.convert.safetensors import Checkpoint
    from colibrid.tools.convert.quant_spec import parse_quant
    from colibrid.engine.experts.source import PreadExpertSource
    from colibrid.pack import Pack

    ckpt, reference = mxfp4_checkpoint
    report = convert(ckpt, tmp_path / "pack", parse_quant("dense=f32,embeddings=f32"), progress=False)  # experts: as published
    assert report.quantization["experts"] == "mxfp4"
    assert {"BF16", "MXFP4", "U8"} <= set(Checkpoint(ckpt).source_dtypes)
    pack = Pack.open(tmp_path / "pack")
    assert [pack.manifest.expert_parts[p].type for p in ("gate", "up", "down", "gate_bias")] == ["mxfp4"] * 3 + ["f32"]
    source = PreadExpertSource(pack)
    from colibrid import native

    for layer, expert in ((0, 0), (2, 7)):
        ours = source.get(layer, expert)
        experts = reference.model.layers[layer].mlp.experts
        gate_up = experts.gate_up_proj[expert].detach().numpy()  # (D, 2F), the decoded values
        decode = lambda t: native.dequantize(t.type, t.data, *t.shape)  # noqa: E731
        np.testing.assert_array_equal(decode(ours.gate), gate_up[:, 0::2].T)
        np.testing.assert_array_equal(decode(ours.up), gate_up[:, 1::2].T)
        np.testing.assert_array_equal(decode(ours.down), experts.down_proj[expert].detach().numpy().T)


def test_mxfp4_experts_match_transformers_on_the_portable_level(mxfp4_checkpoint, tmp_path):
    from colibrid import native
    from colibrid.tools.convert.converter import convert
    from colibrid.tools.convert.quant_spec import parse_quant
    from colibrid.engine import load

    ckpt, reference = mxfp4_checkpoint
    convert(ckpt, tmp_path / "pack", parse_quant("dense=f32,embeddings=f32"), progress=False)  # experts: as published
    before = native.kernels()
    native.set_kernels("portable")  # float activations: the decoded MXFP4 values exactly
    try:
        engine = load(tmp_path / "pack")
        assert_same_model(reference, engine, random_prompt(engine.config.vocab_size, seed=2))
    finally:
        native.set_kernels(before)


# --- configs as published -------------------------------------------------------------------

GPT_OSS_20B_STYLE = {  # the shape of openai/gpt-oss-20b's config.json (smaller numbers)
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 7, "experts_per_token": 4, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
    "initial_context_length": 4096, "intermediate_size": 64, "layer_types": ["sliding_attention", "full_attention"] * 2,
    "max_position_embeddings": 131072, "num_attention_heads": 8, "num_experts_per_tok": 4, "num_hidden_layers": 4,
    "num_key_value_heads": 2, "num_local_experts": 32, "pad_token_id": 6,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 1000,
}


def test_published_gpt_oss_20b_config():
    arch = architecture_for(GPT_OSS_20B_STYLE)
    c = arch.model_config(GPT_OSS_20B_STYLE)
    assert (c.head_dim, c.num_heads, c.num_kv_heads, c.rope.theta) == (16, 8, 2, 150000.0)
    assert c.rope.type == "yarn" and (c.rope.factor, c.rope.original_max_position_embeddings) == (32.0, 4096)
    assert c.rope.truncate is False and c.rope.attention_factor is None
    assert c.sliding_window == (128, None, 128, None)
    assert (c.num_experts, c.num_experts_per_tok, c.expert_ffn) == (32, 4, 64) and all(c.moe_layers)
    assert (c.swiglu_alpha, c.swiglu_limit) == (1.702, 7.0)  # alpha: transformers' default, absent from the file
    optional = arch.optional_tensors(GPT_OSS_20B_STYLE)
    assert optional == {"qkv_bias", "o_bias", "attention_sinks", "router_bias", "expert_bias"}
    names = arch.dense_tensor_names(c, optional)
    assert names["layers.1.router"] == "model.layers.1.mlp.router.weight"
    assert names["layers.1.router_bias"] == "model.layers.1.mlp.router.bias"
    assert names["layers.1.attn.sinks"] == "model.layers.1.self_attn.sinks"
    assert names["layers.1.attn.o_bias"] == "model.layers.1.self_attn.o_proj.bias"
    expert = arch.expert_tensor_names(2, 5)
    assert str(expert.gate) == "model.layers.2.mlp.experts.gate_up_proj[5, ::2].T"
    assert str(expert.up_bias) == "model.layers.2.mlp.experts.gate_up_proj_bias[5, 1::2]"


def test_a_missing_tensor_is_refused_naming_the_family(packs, tmp_path):
    from safetensors.numpy import load_file, save_file

    from colibrid.tools.convert.converter import ConversionError, convert
    from colibrid.tools.convert.quant_spec import parse_quant

    ckpt = shutil.copytree(packs.checkpoint(SPECS[0]), tmp_path / "ckpt")
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_bias"]
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"gpt_oss checkpoint .* lacks tensor model\.layers\.1\.mlp\.experts\.down_proj_bias"):
        convert(ckpt, tmp_path / "out", parse_quant("f32"), progress=False)


# --- the pack's manifest: the gpt-oss fields are checked at open -----------------------------

MANIFEST_CORRUPTIONS = [
    ("expert biases dropped from the model", lambda m: m["model"].update(expert_bias=False),
     ["experts.parts must be ['gate', 'up', 'down']"]),
    ("a bias part stored as the experts' type", lambda m: m["experts"]["parts"]["down_bias"].update(type="q8_0"),
     ["expert part 'down_bias' in experts.bin", "stores it as f32"]),
    ("a bias part of the wrong shape", lambda m: m["experts"]["parts"]["up_bias"].update(shape=[32]),
     ["expert part 'up_bias' in experts.bin: shape [32], the model needs [64]"]),
    ("sinks dropped from the model", lambda m: m["model"].update(attention_sinks=False),
     ["'layers.0.attn.sinks'", "is not one this model has"]),
    ("router bias as a number", lambda m: m["model"].update(router_bias=1), ["model.router_bias must be true or false"]),
    ("a clamp of zero", lambda m: m["model"].update(swiglu_limit=0.0), ["model.swiglu_limit must be > 0"]),
    ("a sigmoid gain as a string", lambda m: m["model"].update(swiglu_alpha="1.702"),
     ["model.swiglu_alpha must be a finite number"]),
    ("an unknown activation", lambda m: m["model"].update(expert_activation="gelu"), ["expert_activation"]),
    ("an unknown router scoring", lambda m: m["model"].update(router_scoring="top1"), ["router_scoring"]),
]


@pytest.mark.parametrize("mutate, fragments", [c[1:] for c in MANIFEST_CORRUPTIONS], ids=[c[0] for c in MANIFEST_CORRUPTIONS])
def test_a_corrupt_gpt_oss_manifest_is_refused_naming_what(mutate, fragments, packs, tmp_path):
    pack = shutil.copytree(packs.pack(SPECS[0], "q8_0"), tmp_path / "pack")
    assert_refused_after(pack, mutate, fragments)


def test_the_step_by_step_expert_path_computes_what_the_fused_one_does(packs):
    """Experts whose parts differ in type (never written by the converter) run one at a time in
    numpy glue (moe._expert_ffn): the same biases and clamped SwiGLU as col_moe_experts_ffn."""
    from colibrid import native
    from colibrid.engine.experts.source import PreadExpertSource
    from colibrid.engine.forward.moe import _expert_ffn
    from colibrid.pack import Pack

    pack = Pack.open(packs.pack(SPECS[1], "f32"))
    config, expert = pack.manifest.model, PreadExpertSource(pack).get(1, 2)
    x = np.random.default_rng(5).standard_normal((3, config.hidden_size)).astype(np.float32)
    fused = np.zeros_like(x)
    native.moe_experts_of([expert.kernel_buffers], x, np.zeros((3, 1), np.int32), np.ones((3, 1), np.float32), fused,
                          activation=config.expert_activation, alpha=config.swiglu_alpha, limit=config.swiglu_limit)
    np.testing.assert_allclose(_expert_ffn(config, x, expert), fused, rtol=1e-5, atol=1e-6)


def test_pack_size_tool_counts_the_expert_biases_and_mxfp4(packs, mxfp4_checkpoint, tmp_path):
    """tools/pack_size.py (how docs/models.md's sizes are computed) gives the byte sizes the
    converter writes for gpt_oss: expert records with their f32 biases, and MXFP4 experts."""
    import sys
    from pathlib import Path

    from colibrid.tools.convert.converter import convert
    from colibrid.tools.convert.quant_spec import parse_quant
    from colibrid.pack import Pack

    tools = str(Path(__file__).resolve().parents[2] / "tools")
    sys.path.insert(0, tools)
    try:
        from pack_size import pack_bytes
    finally:
        sys.path.remove(tools)
    ckpt, _ = mxfp4_checkpoint
    converted = [(packs.pack(SPECS[0], quant), quant) for quant in ("f32", "experts=q4_g64,dense=q8_0,embeddings=q8_0")]
    convert(ckpt, tmp_path / "mxfp4", parse_quant(None), progress=False)
    converted.append((tmp_path / "mxfp4", "experts=mxfp4"))
    for pack, quant in converted:
        manifest = Pack.open(pack).manifest
        expected = ((pack / "dense.bin").stat().st_size, (pack / "experts.bin").stat().st_size)
        assert pack_bytes(manifest.model, manifest.optional_tensors, parse_quant(quant).to_json()) == expected, quant
