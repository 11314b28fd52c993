"""Checkpoints as they are published: sharded with an index, a text model wrapped in a
multimodal one (config under text_config, weights under a prefix), tied and untied heads in
every family; a missing shard or tensor is named together with the family."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from colibrid.tools.convert.converter import ConversionError, convert
from colibrid.tools.convert.quant_spec import parse_quant
from colibrid.tools.convert.safetensors import Checkpoint
from colibrid.models import ARCHITECTURES
from tests.tiny_checkpoints import ARCH_CLASSES, CheckpointSpec, assert_same_model, load_reference, random_prompt

FAMILIES = sorted(set(ARCH_CLASSES) & set(ARCHITECTURES))


def _convert(src: Path, out: Path, quant: str = "f32"):
    return convert(src, out, parse_quant(quant), progress=False)


def _copy(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst))


# --- sharded checkpoints ------------------------------------------------------------------


def test_sharded_checkpoint_converts_as_the_single_file(packs, tmp_path):
    """The same weights saved in one file and in shards with an index make identical packs."""
    single, sharded = CheckpointSpec("glm4_moe"), CheckpointSpec("glm4_moe", max_shard_size="60KB")
    assert len(list(packs.checkpoint(sharded).glob("model-*-of-*.safetensors"))) > 1
    assert (packs.checkpoint(sharded) / "model.safetensors.index.json").is_file()
    a, b = packs.pack(single, "f32"), packs.pack(sharded, "f32")
    for name in ("dense.bin", "experts.bin"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


@pytest.mark.parametrize("family", FAMILIES)
def test_missing_shard_names_the_family_and_the_shard(packs, tmp_path, family):
    ckpt = _copy(packs.checkpoint(CheckpointSpec(family, max_shard_size="60KB")), tmp_path / "ckpt")
    shards = sorted(ckpt.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    with pytest.raises(ConversionError, match=f"^{family} checkpoint: missing shard {shards[-1].name}"):
        _convert(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_shard_index_naming_a_path_is_refused(packs, tmp_path):
    ckpt = _copy(packs.checkpoint(CheckpointSpec("olmoe", max_shard_size="60KB")), tmp_path / "ckpt")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    (tmp_path / "elsewhere.safetensors").write_bytes((ckpt / index["weight_map"][name]).read_bytes())
    index["weight_map"][name] = "../elsewhere.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConversionError, match="not a file name"):
        _convert(ckpt, tmp_path / "out")


@pytest.mark.parametrize("family", FAMILIES)
def test_missing_tensor_names_the_family_and_the_tensor(packs, tmp_path, family):
    from safetensors.numpy import load_file, save_file

    ckpt = _copy(packs.checkpoint(CheckpointSpec(family)), tmp_path / "ckpt")
    config = ARCHITECTURES[family].model_config(json.loads((ckpt / "config.json").read_text()))
    arch = ARCHITECTURES[family].for_checkpoint(config, Checkpoint(ckpt).has)  # as the converter binds it
    for missing in (str(arch.expert_tensor_names(config.moe_layer_ids[-1], 1).down), "model.norm.weight"):
        tensors = load_file(ckpt / "model.safetensors")
        name = missing if missing in tensors else missing.split("[")[0]  # a fused tensor goes whole
        del tensors[name]
        save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ConversionError, match=f"^{family} checkpoint .* lacks tensor {name}"):
            _convert(ckpt, tmp_path / "out")
        shutil.copyfile(packs.checkpoint(CheckpointSpec(family)) / "model.safetensors", ckpt / "model.safetensors")


# --- a text model inside a multimodal wrapper -------------------------------------------------


def _wrap(src: Path, dst: Path, decoder_prefix: str, head_prefix: str, top_level: dict | None = None) -> Path:
    """``src`` republished as a multimodal checkpoint: its config under text_config, its
    weights renamed under the wrapper's prefixes, plus a vision tower's tensors."""
    from safetensors.numpy import load_file, save_file

    dst = _copy(src, dst)
    text_config = json.loads((src / "config.json").read_text())
    config = {"model_type": "toy_vl", "architectures": ["ToyVLForConditionalGeneration"],
              "text_config": text_config, "vision_config": {"model_type": "toy_vision", "hidden_size": 16},
              **(top_level or {})}
    (dst / "config.json").write_text(json.dumps(config))
    tensors = {}
    for name, array in load_file(src / "model.safetensors").items():
        if name.startswith("model."):
            name = decoder_prefix + name[len("model."):]
        elif name.startswith("lm_head."):
            name = head_prefix + name
        tensors[name] = array
    tensors["model.visual.patch_embed.proj.weight"] = np.ones((16, 3, 2, 2), np.float32)
    tensors["multi_modal_projector.linear_1.weight"] = np.ones((64, 16), np.float32)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("decoder_prefix, head_prefix", [
    ("model.language_model.", ""),  # transformers 5's layout
    ("language_model.model.", "language_model."),  # the older LLaVA-style layout
])
def test_wrapped_text_model_converts_as_the_plain_one(packs, tmp_path, caplog, decoder_prefix, head_prefix):
    from colibrid.pack import Pack

    spec = CheckpointSpec("glm4_moe")
    wrapped = _wrap(packs.checkpoint(spec), tmp_path / "wrapped", decoder_prefix, head_prefix)
    with caplog.at_level("WARNING"):
        report = _convert(wrapped, tmp_path / "out")
    assert "toy_vl: converting its glm4_moe text model (text_config); the vision tower and projector are left out" \
        in caplog.text
    plain = packs.pack(spec, "f32")
    assert report.architecture == "glm4_moe"
    assert Pack.open(tmp_path / "out").manifest.model == Pack.open(plain).manifest.model
    assert Pack.open(tmp_path / "out").manifest.source["wrapper_model_type"] == "toy_vl"
    for name in ("dense.bin", "experts.bin"):
        assert (tmp_path / "out" / name).read_bytes() == (plain / name).read_bytes()


def test_wrapper_top_level_keys_reach_the_text_model(packs, tmp_path):
    """tie_word_embeddings (and quantization_config, eos) may sit at the wrapper's top level."""
    from colibrid.pack import Pack

    spec = CheckpointSpec("olmoe", {"tie_word_embeddings": True})
    src = packs.checkpoint(spec)
    text_config = json.loads((src / "config.json").read_text())
    wrapped = _wrap(src, tmp_path / "wrapped", "model.language_model.", "", {"tie_word_embeddings": True})
    config = json.loads((wrapped / "config.json").read_text())
    del config["text_config"]["tie_word_embeddings"]
    (wrapped / "config.json").write_text(json.dumps(config))
    _convert(wrapped, tmp_path / "out")
    model = Pack.open(tmp_path / "out").manifest.model
    assert text_config["tie_word_embeddings"] and model.tie_word_embeddings
    assert "lm_head" not in Pack.open(tmp_path / "out").manifest.dense_tensors


def test_wrapped_unsupported_text_model_names_both(packs, tmp_path):
    wrapped = _wrap(packs.checkpoint(CheckpointSpec("olmoe")), tmp_path / "wrapped", "model.language_model.", "")
    config = json.loads((wrapped / "config.json").read_text())
    config["text_config"]["model_type"] = "toy_vl_text"
    (wrapped / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match="unsupported architecture 'toy_vl_text'.*the text model of 'toy_vl'"):
        _convert(wrapped, tmp_path / "out")


# --- tied and untied heads, every family ------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_tied_and_untied_heads(packs, family, tied):
    """The head is the embedding when tie_word_embeddings (no lm_head in the checkpoint nor the
    pack), its own tensor otherwise; either way the pack is the transformers model."""
    from colibrid.engine import load
    from colibrid.pack import Pack

    spec = CheckpointSpec(family, {"tie_word_embeddings": tied}, seed=3)
    checkpoint = packs.checkpoint(spec)
    from safetensors import safe_open

    with safe_open(checkpoint / "model.safetensors", "np") as f:
        assert ("lm_head.weight" in f.keys()) == (not tied)
    pack = packs.pack(spec, "f32")
    manifest = Pack.open(pack).manifest
    assert manifest.model.tie_word_embeddings == tied
    assert ("lm_head" in manifest.dense_tensors) == (not tied)

    engine = load(pack)
    assert_same_model(load_reference(checkpoint), engine, random_prompt(engine.config.vocab_size, 16))
