"""Converter failure paths: one clear line, and never a loadable pack left behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.tiny_checkpoints import CheckpointSpec, build_checkpoint

SHARDED = CheckpointSpec("olmoe", max_shard_size="60KB")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "colibrid.tools.convert.cli", *args], capture_output=True, text=True, timeout=300)


def _assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("colibri-convert: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_missing_shard(packs, tmp_path):
    ckpt = _copy(packs.checkpoint(SHARDED), tmp_path / "ckpt")
    shards = sorted(ckpt.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[1].unlink()
    result = _run_cli(str(ckpt), str(tmp_path / "out"))
    _assert_one_line_error(result, "missing shard", shards[1].name)
    assert not (tmp_path / "out").exists()


def test_corrupt_safetensors_header_length(packs, tmp_path):
    ckpt = _copy(packs.checkpoint(CheckpointSpec("olmoe")), tmp_path / "ckpt")
    with open(ckpt / "model.safetensors", "r+b") as f:
        f.write(struct.pack("<Q", 1 << 40))
    _assert_one_line_error(_run_cli(str(ckpt), str(tmp_path / "out")), "corrupt safetensors header", "model.safetensors")
    assert not (tmp_path / "out").exists()


def test_corrupt_safetensors_header_json(packs, tmp_path):
    ckpt = _copy(packs.checkpoint(CheckpointSpec("olmoe")), tmp_path / "ckpt")
    with open(ckpt / "model.safetensors", "r+b") as f:
        f.seek(8)
        f.write(b"\xff{{not json")
    _assert_one_line_error(_run_cli(str(ckpt), str(tmp_path / "out")), "corrupt safetensors header")


def test_unknown_architecture_lists_supported(packs, tmp_path):
    ckpt = _copy(packs.checkpoint(CheckpointSpec("olmoe")), tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    config["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(config))
    _assert_one_line_error(_run_cli(str(ckpt), str(tmp_path / "out")),
                           "unsupported architecture 'llama'", "deepseek_v2, deepseek_v3, gemma4, glm4_moe, gpt_oss, llama4, mixtral, olmoe, qwen2_moe, qwen3_5_moe, qwen3_moe, qwen3_next")


def test_missing_tensor_is_named(packs, tmp_path):
    from safetensors.numpy import load_file, save_file

    ckpt = _copy(packs.checkpoint(CheckpointSpec("olmoe")), tmp_path / "ckpt")
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    _assert_one_line_error(_run_cli(str(ckpt), str(tmp_path / "out")), "model.layers.1.mlp.experts.5.up_proj.weight")


def test_shape_mismatch_is_named(packs, tmp_path):
    ckpt = _copy(packs.checkpoint(CheckpointSpec("olmoe")), tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    config["intermediate_size"] = 128
    (ckpt / "config.json").write_text(json.dumps(config))
    _assert_one_line_error(_run_cli(str(ckpt), str(tmp_path / "out")), "has shape", "expected")


def test_existing_output_needs_force(packs, tmp_path):
    ckpt = packs.checkpoint(CheckpointSpec("olmoe"))
    out = tmp_path / "out"
    assert _run_cli(str(ckpt), str(out), "--quant", "f32").returncode == 0
    _assert_one_line_error(_run_cli(str(ckpt), str(out)), "--force")
    assert _run_cli(str(ckpt), str(out), "--force", "--quant", "q8_0").returncode == 0
    assert json.loads((out / "manifest.json").read_text())["quantization"]["dense"] == "q8_0"


def test_bad_quant_spec_is_a_usage_error(packs, tmp_path):
    ckpt = packs.checkpoint(CheckpointSpec("olmoe"))
    result = _run_cli(str(ckpt), str(tmp_path / "out"), "--quant", "experts=q3")
    assert result.returncode == 2 and "unknown type 'q3'" in result.stderr


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_conversion_killed_half_way_leaves_nothing_loadable(tmp_path, sig):
    from colibrid.pack import Pack, PackError

    # Large enough that the conversion is still running when we see its temporary directory.
    spec = CheckpointSpec("olmoe", {"hidden_size": 256, "intermediate_size": 512, "num_experts": 16,
                                    "num_hidden_layers": 4})
    ckpt = build_checkpoint(spec, tmp_path / "ckpt")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "colibrid.tools.convert.cli", str(ckpt), str(out), "--quant", "q4_g64"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    partial = []
    while time.monotonic() < deadline and not partial and proc.poll() is None:
        partial = [p for p in tmp_path.glob(".out.partial-*") if (p / "experts.bin").exists()
                   and (p / "experts.bin").stat().st_size > 0]
        time.sleep(0.002)
    assert partial, "the conversion finished before it could be interrupted"
    os.kill(proc.pid, sig)
    proc.wait(timeout=60)
    assert not out.exists()
    with pytest.raises(PackError):
        Pack.open(out)
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and not partial[0].exists()  # cleaned up on the way out
    # The next conversion succeeds and removes what the killed one left behind.
    assert _run_cli(str(ckpt), str(out), "--quant", "q8_0").returncode == 0
    assert not list(tmp_path.glob(".out.partial-*"))
    Pack.open(out)
