"""The manifest's experts.device record is read as hostile input like the rest: a pack id in
canonical UUID form, a region start on the alignment after the superblock, a logical block
size that divides the alignment, only in format version 3, never beside experts.file."""

from __future__ import annotations

import json

import pytest

from colibrid.pack import Manifest, PackError
from colibrid.pack.validate import check_manifest

DEVICE = {"pack_id": "6f1c2b9a-4d3e-4f5a-9b8c-7d6e5f4a3b2c", "region_offset": 4096, "logical_block_size": 512,
          "identity": {"name": "loop3", "size_bytes": 1 << 26}}


@pytest.fixture
def device_manifest(demo_pack, tmp_path):
    """The demo pack's manifest turned into a device pack's (only the manifest: nothing is opened)."""
    data = json.loads((demo_pack / "manifest.json").read_text())
    data["format_version"] = 3
    data["experts"]["file"] = None
    data["experts"]["device"] = dict(DEVICE)
    return data


def _read(tmp_path, data) -> Manifest:
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    manifest = Manifest.read(tmp_path)
    check_manifest(manifest)
    return manifest


def test_a_device_record_round_trips(device_manifest, tmp_path):
    manifest = _read(tmp_path, device_manifest)
    assert manifest.experts_device.to_json() == DEVICE
    assert manifest.to_json()["experts"]["device"] == DEVICE and manifest.to_json()["format_version"] == 3


@pytest.mark.parametrize("what, change, message", [
    ("a pack id that is no UUID", lambda d: d["experts"]["device"].update(pack_id="../../etc"), "canonical form"),
    ("a pack id not in canonical form", lambda d: d["experts"]["device"].update(pack_id=DEVICE["pack_id"].upper()),
     "canonical form"),
    ("an unknown key", lambda d: d["experts"]["device"].update(path="/dev/sda"), "unknown keys"),
    ("a region over the superblock", lambda d: d["experts"]["device"].update(region_offset=0), "positive multiple"),
    ("a region off the alignment", lambda d: d["experts"]["device"].update(region_offset=6144), "positive multiple"),
    ("a block size above the alignment", lambda d: d["experts"]["device"].update(logical_block_size=8192),
     "logical_block_size 8192"),
    ("a float", lambda d: d["experts"]["device"].update(region_offset=4096.0), "must be an integer"),
    ("a huge identity", lambda d: d["experts"]["device"]["identity"].update(serial="x" * 5000), "short strings"),
    ("version 2", lambda d: d.update(format_version=2), "needs format version 3"),
    ("a file beside the device", lambda d: d["experts"].update(file="experts.bin"), "must be null"),
])
def test_a_malformed_device_record_is_refused(device_manifest, tmp_path, what, change, message):
    change(device_manifest)
    with pytest.raises((PackError, ValueError), match=message):
        _read(tmp_path, device_manifest)
