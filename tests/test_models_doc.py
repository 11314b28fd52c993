"""docs/models.md describes every supported family, and what it says about tokenizers and
pack sizes is what the code does."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from colibrid.tools.convert.tiktoken_tokenizer import KIMI_K2_PATTERN
from colibrid.models import ARCHITECTURES

REPO = Path(__file__).resolve().parents[1]
DOC = (REPO / "docs" / "models.md").read_text()


def _sections() -> dict[str, str]:
    parts = re.split(r"^## ", DOC, flags=re.M)[1:]
    return {part.split(" ", 1)[0].strip(): part for part in parts}


@pytest.mark.parametrize("family", sorted(ARCHITECTURES))
def test_every_family_has_a_section(family):
    section = _sections().get(family)
    assert section is not None, f"docs/models.md has no '## {family} — ...' section"
    for part in ("Real model:", "Config keys read:", "Not supported"):
        assert part in section, f"{family}: no {part!r}"
    assert re.search(r"^\| experts=q4_g64, dense=q8_0, embeddings=q8_0 \(default\) \|", section, flags=re.M), family


def test_documented_kimi_pattern_is_the_one_the_option_names():
    blocks = re.findall(r"^```\n(.*?)\n```", DOC, flags=re.M | re.S)
    assert KIMI_K2_PATTERN in blocks


def test_pack_size_tool_matches_a_conversion(packs):
    """tools/pack_size.py (how the documented sizes are computed) gives the byte sizes of the
    files the converter writes, for each tensor-class type mix."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        from pack_size import pack_bytes
    finally:
        sys.path.remove(str(REPO / "tools"))
    from colibrid.tools.convert.quant_spec import parse_quant
    from colibrid.pack import Pack
    from tests.tiny_checkpoints import CheckpointSpec

    for spec in (CheckpointSpec("qwen2_moe"), CheckpointSpec("glm4_moe", {"tie_word_embeddings": True}),
                 CheckpointSpec("deepseek_v3"), CheckpointSpec("qwen3_5_moe")):
        for quant in ("f32", "experts=q4_g64,dense=q8_0,embeddings=q8_0", "bf16"):
            pack = packs.pack(spec, quant)
            manifest = Pack.open(pack).manifest
            expected = ((pack / "dense.bin").stat().st_size, (pack / "experts.bin").stat().st_size)
            assert pack_bytes(manifest.model, manifest.optional_tensors, parse_quant(quant).to_json()) == expected, \
                (spec.name, quant)


def test_pack_size_tool_runs(tmp_path):
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "olmoe", "hidden_size": 2048, "intermediate_size": 1024, '
                      '"num_hidden_layers": 16, "num_attention_heads": 16, "num_experts": 64, '
                      '"num_experts_per_tok": 8, "vocab_size": 50304}')
    result = subprocess.run([sys.executable, str(REPO / "tools" / "pack_size.py"), str(config)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "olmoe: 6.9 B parameters, 1.3 B active per token" in result.stdout
    assert "total     4.1 GB" in result.stdout
