"""colibri-verify: a whole pack checked against its manifest - every expert record's and
dense tensor's CRC-32C, the manifest's consistency and the SHA-256 of every file - with each
finding naming the file and where in it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from tests.pack.conftest import flip_byte


@pytest.fixture
def demo_copy(demo_pack, tmp_path):
    """A writable copy of the random-weight demo pack (4 MoE layers of 16 experts)."""
    return shutil.copytree(demo_pack, tmp_path / "demo.pack")


def _manifest(pack):
    return json.loads((pack / "manifest.json").read_text())


def _verify(pack, **kwargs):
    from colibrid.pack.verify import verify_pack

    return verify_pack(pack, **kwargs)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "colibrid.tools.verify_cli", *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def test_conversion_records_each_files_sha256_and_the_manifests_own(demo_pack):
    from colibrid.pack.manifest import Manifest, manifest_content_sha256

    manifest = _manifest(demo_pack)
    files = sorted(p.name for p in demo_pack.iterdir() if p.name != "manifest.json")
    assert sorted(manifest["sha256"]) == files
    for name, digest in manifest["sha256"].items():
        assert hashlib.sha256((demo_pack / name).read_bytes()).hexdigest() == digest, name
    assert manifest_content_sha256(manifest) == manifest["manifest_sha256"] == Manifest.read(demo_pack).manifest_sha256


def test_a_clean_pack_verifies(demo_pack):
    report = _verify(demo_pack)
    assert report.clean and report.damage == [] and report.notes == []
    assert set(report.files.values()) == {"ok"}
    assert report.bytes_read == sum(p.stat().st_size for p in demo_pack.iterdir() if p.name != "manifest.json")
    result = _cli(demo_pack)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "intact" in result.stdout and "every SHA-256 matches" in result.stdout


def test_a_flipped_byte_in_an_expert_record_is_found_by_layer_expert_and_offset(demo_copy):
    from colibrid.pack import Pack

    target = next(r for r in Pack.open(demo_copy).manifest.expert_records if (r.layer, r.expert) == (2, 11))
    flip_byte(demo_copy / "experts.bin", target.offset + 777, mask=0x10)
    seen = []
    from colibrid.pack.verify_report import VerifyControls

    report = _verify(demo_copy, controls=VerifyControls(on_expert=lambda record, ok, crc: seen.append((record, ok))))
    assert not report.clean
    record_damage = [d for d in report.damage if d.layer is not None]
    assert len(record_damage) == 1
    found = record_damage[0]
    assert (found.file, found.layer, found.expert, found.offset, found.length) == \
        ("experts.bin", 2, 11, target.offset, target.length)
    assert f"expert 11 of layer 2 (experts.bin bytes {target.offset}.." in found.message
    # the whole-file digest disagrees too, and says the damaged record is why
    assert any(d.file == "experts.bin" and "SHA-256" in d.message and "damaged parts" in d.message
               for d in report.damage)
    assert [record for record, ok in seen if not ok] == [target] and len(seen) == 4 * 16
    assert report.files["experts.bin"] == "damaged" and report.files["dense.bin"] == "ok"

    result = _cli("--json", demo_copy)
    assert result.returncode == 1
    events = [json.loads(line) for line in result.stdout.splitlines()]
    damage = [e for e in events if e["event"] == "verify_damage" and "layer" in e]
    assert [(e["layer"], e["expert"], e["offset"]) for e in damage] == [(2, 11, target.offset)]
    assert events[-1]["event"] == "verified" and events[-1]["clean"] is False


def test_a_flipped_byte_in_a_dense_tensor_is_found_by_name_and_offset(demo_copy):
    from colibrid.pack import Pack

    entry = Pack.open(demo_copy).manifest.dense_tensors["layers.1.attn.k"]
    flip_byte(demo_copy / "dense.bin", entry.offset + entry.nbytes - 1)
    report = _verify(demo_copy)
    tensors = [d for d in report.damage if d.tensor is not None]
    assert [(d.file, d.tensor, d.offset, d.length) for d in tensors] == \
        [("dense.bin", "layers.1.attn.k", entry.offset, entry.nbytes)]
    assert "dense tensor 'layers.1.attn.k' (dense.bin bytes" in tensors[0].message
    assert report.files == {**report.files, "dense.bin": "damaged", "experts.bin": "ok"}
    result = _cli(demo_copy)
    assert result.returncode == 1 and "DAMAGED dense tensor 'layers.1.attn.k'" in result.stdout


def test_a_flipped_byte_in_the_tokenizer_is_found_by_its_sha256(demo_copy):
    flip_byte(demo_copy / "tokenizer.json", 100, mask=0x02)
    report = _verify(demo_copy)
    assert [(d.file, "SHA-256" in d.message) for d in report.damage] == [("tokenizer.json", True)]
    assert report.files["tokenizer.json"] == "damaged"


def test_a_flipped_byte_in_the_padding_of_dense_bin_is_a_sha256_mismatch_only(demo_copy):
    from colibrid.pack import Pack

    entries = sorted(Pack.open(demo_copy).manifest.dense_tensors.values(), key=lambda e: e.offset)
    gap = next(e.offset + e.nbytes for e, after in zip(entries, entries[1:]) if after.offset > e.offset + e.nbytes)
    flip_byte(demo_copy / "dense.bin", gap)
    report = _verify(demo_copy)
    assert len(report.damage) == 1
    assert report.damage[0].file == "dense.bin" and "every checksummed part matches" in report.damage[0].message


@pytest.mark.parametrize("change, expected", [
    # a changed value that still parses: only the manifest's own SHA-256 can tell
    (lambda text: text.replace('"producer": "colibri-convert', '"producer": "colibri-convers'), "content differs"),
    # a changed dimension: the manifest no longer describes its own tensors
    (lambda text: text.replace('"num_experts": 16', '"num_experts": 17'), "inconsistent"),
    (lambda text: text[:200] + "\x7f" + text[201:], "unreadable manifest"),
])
def test_a_changed_manifest_is_found(demo_copy, change, expected):
    path = demo_copy / "manifest.json"
    text = path.read_text()
    changed = change(text)
    assert changed != text
    path.write_text(changed)
    report = _verify(demo_copy)
    assert not report.clean
    assert any(d.file == "manifest.json" and expected in d.message for d in report.damage), report.damage


def test_a_pack_without_recorded_digests_verifies_by_its_checksums_and_says_so(demo_copy):
    from colibrid.pack import Pack

    manifest = _manifest(demo_copy)
    del manifest["sha256"], manifest["manifest_sha256"]
    (demo_copy / "manifest.json").write_text(json.dumps(manifest, indent=1))
    Pack.open(demo_copy)  # still loads
    report = _verify(demo_copy)
    assert report.clean
    assert any("records no SHA-256 of the pack's files" in note for note in report.notes)
    assert report.files["dense.bin"] == report.files["experts.bin"] == "sha256 not recorded"
    result = _cli(demo_copy)
    assert result.returncode == 0 and "no SHA-256 recorded" in result.stdout and "re-convert" in result.stdout

    flip_byte(demo_copy / "experts.bin", 5)  # still found by the record's CRC-32C
    report = _verify(demo_copy)
    assert [(d.layer, d.expert, d.offset) for d in report.damage] == [(0, 0, 0)]


def test_a_missing_file_a_symlink_and_a_wrong_size_are_each_named(demo_copy, tmp_path):
    (demo_copy / "tokenizer_config.json").unlink()
    outside = tmp_path / "elsewhere.json"
    shutil.move(demo_copy / "generation_config.json", outside)
    os.symlink(outside, demo_copy / "generation_config.json")
    with open(demo_copy / "dense.bin", "ab") as f:
        f.write(b"\0")
    found = {d.file: d.message for d in _verify(demo_copy).damage}
    assert "tokenizer_config.json is missing" in found["tokenizer_config.json"]
    assert "not a regular file" in found["generation_config.json"]
    assert "bytes, the manifest says" in found["dense.bin"]


def test_the_bandwidth_cap_is_honoured(demo_pack):
    from colibrid.pack.verify_report import VerifyControls

    total = sum(p.stat().st_size for p in demo_pack.iterdir() if p.name != "manifest.json")
    cap = total / 1.0  # bytes per second: the whole pack in about a second
    started = time.monotonic()
    report = _verify(demo_pack, controls=VerifyControls(max_bytes_per_s=cap))
    seconds = time.monotonic() - started
    assert report.clean
    # The cap paces the start of each read: the last read starts no earlier than
    # (bytes before it) / cap, and one read is at most a quarter second's worth.
    assert seconds >= 0.7, seconds


def test_a_verify_stops_when_asked(demo_pack):
    from colibrid.pack.verify_report import VerifyControls

    controls = VerifyControls(max_bytes_per_s=1e6)  # about 10 s for the pack
    threading.Timer(0.3, controls.stop.set).start()
    started = time.monotonic()
    report = _verify(demo_pack, controls=controls)
    assert report.cancelled and not report.clean and time.monotonic() - started < 5
