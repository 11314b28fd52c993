"""Llama 4 (llama4, the text model of Llama4ForConditionalGeneration) is the same model as
transformers' Llama4ForCausalLM: MoE on every other layer (dense MLPs of intermediate_size_mlp
between), top-1 and top-2 routing by logit with a sigmoid weight on the expert's input, a
shared expert, RoPE on interleaved pairs (default and Llama 3 scaling), NoPE layers with
attention temperature tuning, the unweighted q/k norm after RoPE on and off, chunked local
attention with chunks shorter than the prompt; from the multimodal checkpoint as published
(Llama4ForConditionalGeneration) too, and from Scout's and Maverick's config.json."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from colibrid.tools.convert.wrapped import text_model_config
from colibrid.models import ARCHITECTURES, UnsupportedConfig, architecture_for
from colibrid.models.model_config import parameter_counts
from tests.pack.conftest import assert_refused_after
from tests.tiny_checkpoints import (GREEDY_TOKENS, CheckpointSpec, assert_same_model, load_reference, random_prompt,
                                    reference_greedy)

# theta 500000 at head_dim 16: wavelengths 6.3 (kept), 32.6 (blended) and 169 on (divided by the factor)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
SPECS = [
    # tiny_checkpoints' llama4: layers 0-2 chunked (8 tokens) with RoPE on pairs and the q/k norm, layer 3 NoPE
    # with temperature tuning (floor 4, scale 0.5); MoE on layers 1 and 3, top-1, dense MLPs on 0 and 2
    CheckpointSpec("llama4"),
    # Maverick's choices: no q/k norm; here also top-2 (MoE on layer 1 only), a NoPE first layer, Llama 3
    # rope scaling (short, medium and long wavelengths), chunks of 8, a bf16 source
    CheckpointSpec("llama4", {"num_hidden_layers": 3, "use_qk_norm": False, "num_experts_per_tok": 2,
                              "no_rope_layers": [0, 1, 1], "rope_parameters": LLAMA3_ROPE}, dtype="bfloat16"),
]


def _prompt(vocab_size: int) -> list[int]:
    return random_prompt(vocab_size)


def _check_against(reference, engine) -> None:
    assert_same_model(reference, engine, _prompt(engine.config.vocab_size))


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_logits_and_greedy_match_transformers(spec, packs):
    from colibrid.engine import load

    _check_against(load_reference(packs.checkpoint(spec)), load(packs.pack(spec, "f32")))


def test_specs_exercise_the_features_they_claim(packs):
    from colibrid.pack import Pack

    packs_ = [Pack.open(packs.pack(spec, "f32")) for spec in SPECS]
    configs = [p.manifest.model for p in packs_]
    assert all(c.architecture == "llama4" and c.rope_interleaved and c.router_weight_on_input for c in configs)
    assert all(c.router_scoring == "topk_sigmoid" and not c.norm_topk_prob for c in configs)
    assert [c.num_experts_per_tok for c in configs] == [1, 2]
    assert [c.moe_layers for c in configs] == [(False, True, False, True), (False, True, False)]
    assert all(c.dense_ffn == 128 and c.shared_expert_ffn == 64 for c in configs)
    assert [c.nope_layers for c in configs] == [(False, False, False, True), (True, False, False)]
    assert [c.qk_norm for c in configs] == ["l2", "none"]
    assert all((c.attn_temperature_floor, c.attn_temperature_scale) == (4, 0.5) for c in configs)
    assert [c.rope.type for c in configs] == ["default", "llama3"]
    assert [c.attention_chunk for c in configs] == [(8, 8, 8, None), (None, 8, 8)]
    assert "layers.1.attn.q_norm" not in packs_[0].manifest.dense_tensors  # the L2 norm has no weight
    assert "layers.0.mlp.gate" in packs_[0].manifest.dense_tensors and "layers.0.router" not in packs_[0].manifest.dense_tensors


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_fused_attention_equals_the_step_by_step_path(spec, packs):
    """The fused libcolibri step (pairs, NoPE, the norm after RoPE, temperature, chunks) gives
    the numpy path's numbers bit for bit: prefill, decode steps across chunk boundaries."""
    from colibrid.engine.engine import Engine
    from colibrid.pack.reader import Pack

    path = packs.pack(spec, "q8_0")
    fused, stepwise = Engine(Pack.open(path)), Engine(Pack.open(path))
    for layer in stepwise.model.layers:
        layer.mixer.fused = None
    ids = _prompt(fused.config.vocab_size)[:20]
    np.testing.assert_array_equal(fused.forward(ids), stepwise.forward(ids))
    sessions = fused.new_session(), stepwise.new_session()
    for part in (ids[:7], ids[7:8], ids[8:9], ids[9:17], ids[17:]):
        a, b = (s.forward(part) for s in sessions)
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_chunked_layers_keep_a_ring_and_stay_token_exact(spec, packs):
    """In steps of 3 tokens the chunked layers keep a ring of chunk + 2 rows (the NoPE layer every
    key): the logits of a flat cache bit for bit, and transformers' greedy tokens, past many wraps."""
    from colibrid.engine.engine import Engine
    from colibrid.engine.forward.kv_cache import KVCache, RingKVCache
    from colibrid.pack.reader import Pack

    path = packs.pack(spec, "f32")
    stepped, whole = Engine(Pack.open(path), max_context=80), Engine(Pack.open(path), max_context=80)
    stepped.model.max_step_tokens = 3
    ringed, flat = stepped.new_session(), whole.new_session()
    chunks = stepped.config.attention_chunk
    assert [isinstance(s, RingKVCache) for s in ringed.state.layers] == [c is not None for c in chunks]
    assert all(s.nbytes == 10 * 2 * 2 * 16 * 4 for s in ringed.state.layers if isinstance(s, RingKVCache))
    assert all(isinstance(s, KVCache) for s in flat.state.layers)
    ids = _prompt(stepped.config.vocab_size)
    np.testing.assert_array_equal(ringed.forward(ids), flat.forward(ids))
    reference = load_reference(packs.checkpoint(spec))
    assert stepped.greedy(ids, GREEDY_TOKENS) == reference_greedy(reference, ids, GREEDY_TOKENS)


def test_decode_across_chunks_equals_prefill(packs):
    from colibrid.engine import load

    engine = load(packs.pack(SPECS[0], "f32"))
    ids = _prompt(engine.config.vocab_size)[:21]
    full = engine.forward(ids)
    session = engine.new_session()
    rows = [session.forward(ids[:6])] + [session.forward([t]) for t in ids[6:]]
    np.testing.assert_allclose(np.concatenate(rows), full, rtol=0, atol=1e-6 * np.abs(full).max())


def test_experts_are_the_halves_of_the_fused_gate_up(packs):
    """Expert 5's gate and up in the pack are columns [:F] and [F:] of transformers' (D, 2F)
    gate_up_proj, transposed; its down the (F, D) down_proj, transposed."""
    import torch

    from colibrid.engine.experts.source import PreadExpertSource
    from colibrid.pack import Pack

    spec = SPECS[0]
    experts = load_reference(packs.checkpoint(spec)).model.layers[3].feed_forward.experts
    weights = PreadExpertSource(Pack.open(packs.pack(spec, "f32"))).get(3, 5)
    with torch.no_grad():
        gate_up, down = experts.gate_up_proj[5].numpy(), experts.down_proj[5].numpy()
    F = gate_up.shape[1] // 2
    np.testing.assert_array_equal(weights.gate.data, gate_up[:, :F].T)
    np.testing.assert_array_equal(weights.up.data, gate_up[:, F:].T)
    np.testing.assert_array_equal(weights.down.data, down.T)


@pytest.mark.parametrize("low, high", [(1.0, 4.0), (1.0, 1.0)])  # (1, 1): Scout's, no medium band
def test_llama3_frequencies_are_transformers(low, high):
    import torch
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from colibrid.engine.forward.rope import Rotary
    from colibrid.models.base import rope_config

    params = {**LLAMA3_ROPE, "low_freq_factor": low, "high_freq_factor": high, "rope_theta": 500000.0,
              "original_max_position_embeddings": 8192, "factor": 16.0}  # Scout's, with both factor pairs
    hf = transformers.Llama4TextConfig(hidden_size=5120, num_attention_heads=40, head_dim=128, rope_parameters=params)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf)
    ours = Rotary(rope_config({"rope_parameters": params}, 500000.0), 128)
    # numpy's and torch's float32 pow differ in the last bit for some exponents, as for the default rope
    np.testing.assert_allclose(ours.inv_freq, want.to(torch.float32).numpy(), rtol=1e-6, atol=0)
    assert np.isfinite(ours.inv_freq).all()


# --- the published multimodal checkpoint ----------------------------------------------------


@pytest.fixture(scope="module")
def multimodal_checkpoint(tmp_path_factory):
    """A tiny Llama4ForConditionalGeneration as transformers saves it: config.json of model_type
    llama4 with text_config (llama4_text) and vision_config, the text model under
    language_model.model. / language_model.lm_head., the vision tower and projector beside it."""
    import torch
    import transformers

    from tests.tiny_checkpoints import EXPERTS, _randomize, build_tokenizer

    directory = tmp_path_factory.mktemp("llama4_multimodal") / "ckpt"
    directory.mkdir()
    tokenizer = build_tokenizer(directory)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rms_norm_eps=1e-5, vocab_size=len(tokenizer), eos_token_id=eos, pad_token_id=eos, bos_token_id=None,
                **EXPERTS["llama4"])
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    torch.manual_seed(0)
    model = transformers.Llama4ForConditionalGeneration(transformers.Llama4Config(text_config=text, vision_config=vision))
    _randomize(model, 0.1, seed=4)
    model.save_pretrained(directory)
    # the wrapper's text model, which its forward runs on text-only input (transformers 5's own
    # Llama4ForConditionalGeneration.forward fails without an image: it reads outputs.image_outputs)
    return directory, model.language_model.eval()


def test_the_multimodal_checkpoint_converts_its_text_model(multimodal_checkpoint, tmp_path, caplog):
    from safetensors import safe_open

    from colibrid.tools.convert.converter import convert
    from colibrid.tools.convert.quant_spec import parse_quant
    from colibrid.engine import load
    from colibrid.pack import Pack

    ckpt, reference = multimodal_checkpoint
    assert json.loads((ckpt / "config.json").read_text())["model_type"] == "llama4"
    with safe_open(ckpt / "model.safetensors", "np") as f:
        names = list(f.keys())
    assert "language_model.lm_head.weight" in names and "language_model.model.layers.1.feed_forward.experts.gate_up_proj" in names
    assert any(n.startswith("vision_model.") for n in names) and any(n.startswith("multi_modal_projector.") for n in names)
    with caplog.at_level("WARNING"):
        report = convert(ckpt, tmp_path / "pack", parse_quant("f32"), progress=False)
    assert report.architecture == "llama4"
    assert "llama4: converting its llama4 text model (text_config); the vision tower and projector are left out" in caplog.text
    assert Pack.open(tmp_path / "pack").manifest.source["wrapper_model_type"] == "llama4"
    _check_against(reference, load(tmp_path / "pack"))


# --- configs as published -------------------------------------------------------------------

# the text_config of meta-llama/Llama-4-Scout-17B-16E-Instruct's config.json (the keys Colibri reads)
SCOUT_TEXT = {
    "model_type": "llama4_text", "attention_bias": False, "attention_chunk_size": 8192, "attn_scale": 0.1,
    "attn_temperature_tuning": True, "bos_token_id": 200000, "eos_token_id": [200001, 200007, 200008],
    "floor_scale": 8192, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "interleave_moe_layer_step": 1,
    "intermediate_size": 8192, "intermediate_size_mlp": 16384, "max_position_embeddings": 10485760,
    "moe_layers": list(range(48)), "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(48)],
    "num_attention_heads": 40, "num_experts_per_tok": 1, "num_hidden_layers": 48, "num_key_value_heads": 8,
    "num_local_experts": 16, "pad_token_id": 200018, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 16.0, "high_freq_factor": 1.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "use_qk_norm": True, "vocab_size": 202048,
}
# Maverick's (meta-llama/Llama-4-Maverick-17B-128E-Instruct): 128 experts on every other layer, no q/k
# norm, no rope scaling
MAVERICK_TEXT = dict(SCOUT_TEXT, interleave_moe_layer_step=2, moe_layers=list(range(1, 48, 2)), num_local_experts=128,
                     use_qk_norm=False, rope_scaling=None, max_position_embeddings=1048576)


def _published(text: dict) -> dict:
    return {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "text_config": text,
            "vision_config": {"model_type": "llama4_vision_model"}, "tie_word_embeddings": False}


def _text_config(published: dict) -> dict:
    supported = lambda t: any(t in a.hf_model_types for a in ARCHITECTURES.values())  # noqa: E731
    return text_model_config(published, supported).config


def _read(published: dict):
    hf = _text_config(published)
    return architecture_for(hf).model_config(hf)


def _optional_tensors(published: dict) -> frozenset[str]:
    hf = _text_config(published)
    return architecture_for(hf).optional_tensors(hf)


def test_published_scout_config():
    c = _read(_published(SCOUT_TEXT))
    assert (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers) == (5120, 40, 8, 128, 48)
    assert (c.num_experts, c.num_experts_per_tok, c.expert_ffn, c.shared_expert_ffn) == (16, 1, 8192, 8192)
    assert all(c.moe_layers) and c.dense_ffn == 0
    assert c.nope_layers == tuple((i + 1) % 4 == 0 for i in range(48)) and c.qk_norm == "l2"
    assert c.attention_chunk == tuple(None if (i + 1) % 4 == 0 else 8192 for i in range(48))
    assert (c.attn_temperature_floor, c.attn_temperature_scale) == (8192, 0.1)
    assert c.rope.type == "llama3" and (c.rope.factor, c.rope.low_freq_factor, c.rope.high_freq_factor) == (16.0, 1.0, 1.0)
    assert c.rope.original_max_position_embeddings == 8192 and c.rope.theta == 500000.0
    assert c.eos_token_ids == (200001, 200007, 200008)
    assert _optional_tensors(_published(SCOUT_TEXT)) == frozenset()  # attention_bias false
    assert _optional_tensors(_published(dict(SCOUT_TEXT, attention_bias=True))) == {"qkv_bias", "o_bias"}
    total, active = parameter_counts(c, _optional_tensors(_published(SCOUT_TEXT)))
    assert round(total / 1e9, 1) == 107.8 and round(active / 1e9, 1) == 17.2  # 109 B with the vision tower


def test_published_maverick_config():
    c = _read(_published(MAVERICK_TEXT))
    assert c.num_experts == 128 and c.moe_layer_ids == list(range(1, 48, 2)) and c.dense_ffn == 16384
    assert c.qk_norm == "none" and c.rope.type == "default"
    total, active = parameter_counts(c, _optional_tensors(_published(MAVERICK_TEXT)))
    assert round(total / 1e9, 1) == 400.7 and round(active / 1e9, 1) == 17.2


def test_transformers_fills_in_what_config_json_leaves_out():
    """Without moe_layers, no_rope_layers and layer_types: transformers' defaults."""
    text = {k: v for k, v in SCOUT_TEXT.items() if k not in ("moe_layers", "no_rope_layers")}
    c = _read(_published(dict(text, interleave_moe_layer_step=3, num_hidden_layers=8)))
    assert c.moe_layers == (False, False, True, False, False, True, False, False)
    assert c.nope_layers == (False, False, False, True, False, False, False, True)
    assert c.attention_chunk == (8192, 8192, 8192, None) * 2
    c = _read(_published(dict(text, num_hidden_layers=4, attention_chunk_size=None, attn_temperature_tuning=False)))
    assert c.attention_chunk == () and c.attn_temperature_floor == 0
    with pytest.raises(UnsupportedConfig, match="attention_chunk_size"):
        _read(_published(dict(text, num_hidden_layers=2, attention_chunk_size=None,
                              layer_types=["chunked_attention", "full_attention"])))


# --- the pack's manifest: the Llama 4 fields are checked at open ------------------------------

MANIFEST_CORRUPTIONS = [
    ("NoPE flags as numbers", lambda m: m["model"].update(nope_layers=[0, 0, 0, 1]), ["model.nope_layers"]),
    ("NoPE flags for too few layers", lambda m: m["model"].update(nope_layers=[False]), ["nope_layers"]),
    ("a negative temperature floor", lambda m: m["model"].update(attn_temperature_floor=-1),
     ["model.attn_temperature_floor"]),
    ("a temperature scale as a string", lambda m: m["model"].update(attn_temperature_scale="0.1"),
     ["model.attn_temperature_scale"]),
    ("the input weighting as a number", lambda m: m["model"].update(router_weight_on_input=1),
     ["model.router_weight_on_input must be true or false"]),
    ("pair rope as a string", lambda m: m["model"].update(rope_interleaved="yes"), ["model.rope_interleaved"]),
    ("llama3 rope without its original length", lambda m: m["model"]["rope"].update(
        type="llama3", original_max_position_embeddings=None), ["original_max_position_embeddings"]),
    ("q/k norm weights the L2 norm does not have", lambda m: m["model"].update(qk_norm="head"),
     ["'layers.0.attn.q_norm'", "is missing"]),
]


@pytest.mark.parametrize("mutate, fragments", [c[1:] for c in MANIFEST_CORRUPTIONS], ids=[c[0] for c in MANIFEST_CORRUPTIONS])
def test_a_corrupt_llama4_manifest_is_refused_naming_what(mutate, fragments, packs, tmp_path):
    pack = shutil.copytree(packs.pack(SPECS[0], "q8_0"), tmp_path / "pack")
    assert_refused_after(pack, mutate, fragments)


def test_pack_size_tool_counts_llama4(packs):
    import sys
    from pathlib import Path

    from colibrid.tools.convert.quant_spec import parse_quant
    from colibrid.pack import Pack

    tools = str(Path(__file__).resolve().parents[2] / "tools")
    sys.path.insert(0, tools)
    try:
        from pack_size import pack_bytes
    finally:
        sys.path.remove(tools)
    for quant in ("f32", "experts=q4_g64,dense=q8_0,embeddings=q8_0"):
        pack = packs.pack(SPECS[0], quant)
        expected = ((pack / "dense.bin").stat().st_size, (pack / "experts.bin").stat().st_size)
        manifest = Pack.open(pack).manifest
        assert pack_bytes(manifest.model, manifest.optional_tensors, parse_quant(quant).to_json()) == expected, quant
