"""A hybrid pack's manifest (Qwen3.5-MoE: Gated DeltaNet and gated attention layers) is checked
like any other: its layer_mixers, deltanet dims and output gate against the tensors it lists."""

from __future__ import annotations

import shutil

import pytest

from tests.pack.conftest import assert_refused_after
from tests.tiny_checkpoints import CheckpointSpec

SPEC = CheckpointSpec("qwen3_5_moe")


def _deltanet(**fields):
    return lambda m: m["model"]["deltanet"].update(fields)


def _mixer(layer: int, kind: str):
    return lambda m: m["model"]["layer_mixers"].__setitem__(layer, kind)


CORRUPTIONS = [
    ("value heads not a multiple of key heads", _deltanet(num_value_heads=3), ["model.deltanet.num_value_heads 3"]),
    ("conv kernel as a float", _deltanet(conv_kernel=4.0), ["model.deltanet.conv_kernel must be an integer"]),
    ("a zero head dim", _deltanet(key_head_dim=0), ["model.deltanet.key_head_dim"]),
    ("an unknown deltanet key", _deltanet(chunk=64), ["malformed manifest"]),
    ("an unknown mixer", _mixer(0, "mamba"), ["malformed manifest", "layer_mixers"]),
    ("one mixer too few", lambda m: m["model"]["layer_mixers"].pop(), ["malformed manifest", "layer_mixers"]),
    ("deltanet layers without their dims", lambda m: m["model"].update(deltanet=None), ["malformed manifest"]),
    ("a DeltaNet layer said to be attention", _mixer(0, "attention"),
     ["tensor 'layers.0.attn.q' of dense.bin is missing"]),
    ("an attention layer said to be DeltaNet", _mixer(3, "deltanet"),
     ["tensor 'layers.3.attn.qkv' of dense.bin is missing"]),
    ("no output gate", lambda m: m["model"].update(attention_output_gate=False),
     ["'layers.3.attn.gate'", "is not one this model has"]),
    ("the output gate as a number", lambda m: m["model"].update(attention_output_gate=1),
     ["model.attention_output_gate must be true or false"]),
    ("another value head dim", _deltanet(value_head_dim=8), ["layers.0.attn.qkv", "the model needs [96, 64]"]),
]


@pytest.mark.parametrize("mutate, fragments", [c[1:] for c in CORRUPTIONS], ids=[c[0] for c in CORRUPTIONS])
def test_corrupt_hybrid_fields_are_refused(packs, tmp_path, mutate, fragments):
    from colibrid.pack import Pack

    pack = shutil.copytree(packs.pack(SPEC, "f32"), tmp_path / "pack")
    manifest = Pack.open(pack).manifest
    assert manifest.model.deltanet is not None and "attention_output_gate" in manifest.optional_tensors
    assert_refused_after(pack, mutate, fragments)


def test_a_hybrid_pack_stores_the_conv_in_f32_at_any_quant(packs):
    from colibrid.pack import Pack

    tensors = Pack.open(packs.pack(SPEC, "q8_0")).manifest.dense_tensors
    assert tensors["layers.0.attn.conv"].type == "f32" and tensors["layers.0.attn.conv"].shape == (128, 4)
    assert tensors["layers.0.attn.qkv"].type == "q8_0" and tensors["layers.3.attn.gate"].type == "q8_0"
