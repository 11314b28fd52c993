"""A pack is trusted only as far as it checks out: expert records carry CRC-32C,
files must match the manifest, and unknown format versions are refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.pack.conftest import SPEC, flip_byte


def test_flipped_byte_in_expert_record_is_named(pack_copy):
    from colibrid.engine import load
    from colibrid.engine.experts.source import ExpertChecksumError
    from colibrid.pack import Pack

    record = Pack.open(pack_copy).manifest.expert_records
    target = next(r for r in record if r.layer == 1 and r.expert == 3)
    flip_byte(pack_copy / "experts.bin", target.offset + 100, mask=0x40)

    engine = load(pack_copy)
    ids = np.random.default_rng(0).integers(0, engine.config.vocab_size, 64).tolist()
    with pytest.raises(ExpertChecksumError) as info:
        engine.forward(ids)  # 64 tokens x top-2 of 8 experts: expert 3 of layer 1 is used
    err = info.value
    assert (err.layer, err.expert, err.offset) == (1, 3, target.offset)
    assert f"expert 3 of layer 1 at offset {target.offset}" in str(err)
    # Every other expert still loads.
    engine.experts.get(1, 2)
    engine.experts.get(0, 3)


def test_experts_file_size_mismatch_is_refused(pack_copy):
    from colibrid.pack import Pack, PackError

    with open(pack_copy / "experts.bin", "ab") as f:
        f.write(b"\0" * 4096)
    with pytest.raises(PackError, match="experts.bin has"):
        Pack.open(pack_copy)


def test_unknown_format_version_is_refused(pack_copy):
    from colibrid.pack import Pack, PackError

    manifest = json.loads((pack_copy / "manifest.json").read_text())
    manifest["format_version"] = 99
    (pack_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PackError, match="version 99 is not supported"):
        Pack.open(pack_copy)


def test_records_are_aligned_and_padded(packs):
    from colibrid.pack import Pack

    pack = Pack.open(packs.pack(SPEC, "q4_g64"))
    m = pack.manifest
    assert m.alignment == 4096
    for r in m.expert_records:
        assert r.offset % 4096 == 0 and r.length % 4096 == 0
    for entry in m.dense_tensors.values():
        assert entry.offset % 4096 == 0
    parts = m.expert_parts
    assert parts["gate"].offset == 0 and parts["up"].offset % 64 == 0 and parts["down"].offset % 64 == 0
    assert m.quantization == {"experts": "q4_g64", "dense": "q4_g64", "embeddings": "q4_g64"}
    assert m.dense_tensors["layers.0.router"].type == "f32"  # routers never quantized
    assert m.dense_tensors["layers.0.attn.q"].type == "q4_g64"
