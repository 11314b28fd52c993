"""Optional tensors (biases, attention sinks, the output gate, Gemma's post norms, the router's
extra terms, the shared expert's gate, the layer scalar, expert biases) are what the pack's
tables hold, not fields of ModelConfig. The manifest's model section still states each as a
flag, written from the tables, so a manifest is written exactly as before they left ModelConfig
(and a reader from before reads a new pack right); a manifest written before loads as the same
model and computes the same numbers; the flags must agree with the tables. Tables holding an optional tensor on some layers and not on others are
refused, naming the tensor missing."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from colibrid.models.optional_tensors import OPTIONAL_TENSORS
from tests.pack.conftest import assert_refused_after
from tests.tiny_checkpoints import CheckpointSpec, random_prompt

# Between them, every optional tensor
SPECS = {
    "gpt_oss": (CheckpointSpec("gpt_oss", {"num_hidden_layers": 3}),
                {"qkv_bias", "o_bias", "attention_sinks", "router_bias", "expert_bias"}),
    "gemma4": (CheckpointSpec("gemma4_text"), {"post_norms", "router_input_norm", "router_expert_scale", "layer_scalar"}),
    "qwen3_5_moe": (CheckpointSpec("qwen3_5_moe"), {"attention_output_gate", "shared_expert_gated"}),
    "glm4_moe": (CheckpointSpec("glm4_moe", {"attention_bias": True}), {"qkv_bias", "router_choice_bias"}),
}
QUANT = "q8_0"


def as_written_before(manifest: dict) -> None:
    """``manifest`` (parsed manifest.json) as the converter wrote it while the optional tensors
    were ModelConfig flags: every flag in the model section, true where the model has the
    tensors, and the manifest's own digest over that content."""
    from colibrid.pack.manifest import MANIFEST_SHA256_KEY, manifest_content_sha256

    leaves = {name.split(".", 2)[2] for name in manifest["dense"]["tensors"] if name.startswith("layers.")}
    leaves |= set(manifest["experts"]["parts"])
    manifest["model"].update({flag: bool(leaves.intersection(tensors)) for flag, tensors in OPTIONAL_TENSORS.items()})
    manifest[MANIFEST_SHA256_KEY] = manifest_content_sha256(manifest)


def _rewrite(pack, mutate) -> None:
    path = pack / "manifest.json"
    manifest = json.loads(path.read_text())
    mutate(manifest)
    path.write_text(json.dumps(manifest, indent=1) + "\n")


@pytest.mark.parametrize("family", sorted(SPECS))
def test_a_manifest_written_before_loads_as_the_same_model(family, packs, tmp_path):
    from colibrid.engine import load
    from colibrid.pack import Pack
    from colibrid.pack.verify import verify_pack

    spec, optional = SPECS[family]
    current = packs.pack(spec, QUANT)
    before = shutil.copytree(current, tmp_path / "pack")
    _rewrite(before, as_written_before)
    stated = json.loads((before / "manifest.json").read_text())["model"]
    assert {flag for flag in OPTIONAL_TENSORS if stated[flag]} == optional

    old, new = Pack.open(before).manifest, Pack.open(current).manifest
    assert old.model == new.model and old.optional_tensors == new.optional_tensors == optional
    assert old.model_flags == new.model_flags == {flag: flag in optional for flag in OPTIONAL_TENSORS}
    assert verify_pack(before).clean  # the digest of its own content, as the converter recorded it
    engines = load(before), load(current)
    ids = random_prompt(engines[0].config.vocab_size, 24)
    np.testing.assert_array_equal(engines[0].forward(ids), engines[1].forward(ids))
    assert engines[0].greedy(ids, 8) == engines[1].greedy(ids, 8)
    assert engines[0].parameters_total == engines[1].parameters_total


@pytest.mark.parametrize("family", sorted(SPECS))
def test_a_manifest_is_written_as_before(family, packs):
    # The pack format is unchanged: the flags the model section held, true where the model has
    # the tensors, are still there, and so is the same digest of the content.
    spec, _ = SPECS[family]
    written = json.loads((packs.pack(spec, QUANT) / "manifest.json").read_text())
    before = json.loads(json.dumps(written))
    as_written_before(before)
    assert written == before


def _flag(name, value):
    def mutate(manifest):
        as_written_before(manifest)
        manifest["model"][name] = value
    return mutate


def _drop_dense(name):
    return lambda m: m["dense"]["tensors"].pop(name)


def _add_dense(name, like, stated=None):
    """A dense tensor added to the tables; with ``stated``, the model section also says the
    model has that optional tensor (so the check past the flag is reached)."""
    def mutate(manifest):
        manifest["dense"]["tensors"][name] = dict(manifest["dense"]["tensors"][like])
        if stated is not None:
            manifest["model"][stated] = True
    return mutate


# (case, spec, mutation of manifest.json, fragments the error must contain)
CORRUPTIONS = [
    # a flag that disagrees with the tables
    ("sinks stated absent", "gpt_oss", _flag("attention_sinks", False),
     ["tensor 'layers.0.attn.sinks' in dense.bin is not one this model has"]),
    ("expert biases stated absent", "gpt_oss", _flag("expert_bias", False),
     ["experts.parts must be ['gate', 'up', 'down'] in that order"]),
    ("a layer scalar stated absent", "gemma4", _flag("layer_scalar", False),
     ["tensor 'layers.0.layer_scalar' in dense.bin is not one this model has"]),
    ("o biases stated present", "glm4_moe", _flag("o_bias", True), ["tensor 'layers.0.attn.o_bias' of dense.bin is missing"]),
    ("a flag as a string", "qwen3_5_moe", _flag("shared_expert_gated", "true"),
     ["model.shared_expert_gated must be true or false"]),
    # the tables, which must hold an optional tensor wherever it belongs
    ("the sinks of one layer dropped", "gpt_oss", _drop_dense("layers.1.attn.sinks"),
     ["tensor 'layers.1.attn.sinks' of dense.bin is missing"]),
    ("one layer's router bias dropped", "gpt_oss", _drop_dense("layers.2.router_bias"),
     ["tensor 'layers.2.router_bias' of dense.bin is missing"]),
    ("one expert bias part dropped", "gpt_oss", lambda m: m["experts"]["parts"].pop("up_bias"),
     ["experts.parts must be ['gate', 'up', 'down', 'gate_bias', 'up_bias', 'down_bias'] in that order"]),
    ("a v bias dropped", "glm4_moe", _drop_dense("layers.0.attn.v_bias"), ["tensor 'layers.0.attn.v_bias' of dense.bin is missing"]),
    ("one layer's router norm dropped", "gemma4", _drop_dense("layers.1.router_norm"),
     ["tensor 'layers.1.router_norm' of dense.bin is missing"]),
    ("an output gate on one layer only", "glm4_moe", _add_dense("layers.1.attn.gate", "layers.1.attn.q", "attention_output_gate"),
     ["tensor 'layers.0.attn.gate' of dense.bin is missing"]),
]


@pytest.mark.parametrize("family, mutate, fragments", [c[1:] for c in CORRUPTIONS], ids=[c[0] for c in CORRUPTIONS])
def test_optional_tensors_that_disagree_are_refused(family, mutate, fragments, packs, tmp_path):
    pack = shutil.copytree(packs.pack(SPECS[family][0], QUANT), tmp_path / "pack")
    assert_refused_after(pack, mutate, fragments)


def test_latent_attention_refuses_q_biases(packs, tmp_path):
    pack = shutil.copytree(packs.pack(CheckpointSpec("deepseek_v3"), QUANT), tmp_path / "pack")
    assert_refused_after(pack, _add_dense("layers.0.attn.q_bias", "layers.0.attn.kv_a_norm", "qkv_bias"),
                         ["latent attention has no q/k/v biases"])


def test_a_shared_gate_needs_a_shared_expert(packs, tmp_path):
    pack = shutil.copytree(packs.pack(CheckpointSpec("olmoe"), QUANT), tmp_path / "pack")
    assert_refused_after(pack, _add_dense("layers.0.shared_gate", "layers.0.attn_norm", "shared_expert_gated"),
                         ["model.shared_expert_ffn is 0 but the model needs it"])
