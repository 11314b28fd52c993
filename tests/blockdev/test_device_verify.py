"""colibri-verify on a pack whose experts are on a raw block device (a real loop device): the
conversion records the SHA-256 of the experts region (experts.device.sha256), the verifier
reads the records through the pack's ExpertsRegion - the device found by its superblock, as
the daemon finds it - and a byte flipped in a record on the device is reported by layer,
expert and offset (and LBA), beside the region's SHA-256 mismatch."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

from tests.blockdev.conftest import MIB
from tests.pack.conftest import SPEC, flip_byte

DEVICE_BYTES = 8 * MIB  # the tiny OLMoE's q8_0 experts are far smaller


def _device_pack(loops, packs, tmp_path):
    from colibrid.tools.convert.converter import convert
    from colibrid.tools.convert.quant_spec import parse_quant

    node = loops.attach(DEVICE_BYTES)
    out = tmp_path / "device.pack"
    convert(packs.checkpoint(SPEC), out, parse_quant("q8_0"), progress=False, device=str(node))
    return node, out


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "colibrid.tools.verify_cli", *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def test_a_device_pack_verifies_and_a_flipped_byte_on_the_device_is_found(loops, packs, tmp_path):
    from colibrid.pack import Manifest
    from colibrid.pack.verify import EXPERTS_DEVICE, verify_pack

    node, pack = _device_pack(loops, packs, tmp_path)
    manifest = Manifest.read(pack)
    device = manifest.experts_device
    assert manifest.format_version == 3 and not (pack / "experts.bin").exists()
    assert "experts.bin" not in manifest.file_sha256 and "dense.bin" in manifest.file_sha256
    with open(node, "rb") as f:  # the recorded digest is the region's bytes: the records in index order
        f.seek(device.region_offset)
        assert hashlib.sha256(f.read(manifest.experts_size)).hexdigest() == device.sha256

    report = verify_pack(pack)
    assert report.clean, [d.message for d in report.damage]
    assert report.files[EXPERTS_DEVICE] == "ok" and set(report.files.values()) == {"ok"}
    files_bytes = sum(p.stat().st_size for p in pack.iterdir() if p.name != "manifest.json")
    assert report.bytes_read == files_bytes + manifest.experts_size
    assert _cli(pack).returncode == 0

    target = next(r for r in manifest.expert_records if (r.layer, r.expert) == (1, 3))
    device_byte = device.region_offset + target.offset + 123
    flip_byte(node, device_byte, mask=0x40)
    with open(node, "rb") as f:
        os.fsync(f.fileno())  # on the device, not only in its page cache: the verifier reads with O_DIRECT

    report = verify_pack(pack)
    assert not report.clean and report.files[EXPERTS_DEVICE] == "damaged"
    [found] = [d for d in report.damage if d.layer is not None]
    assert (found.file, found.layer, found.expert, found.offset, found.length) == \
        (EXPERTS_DEVICE, 1, 3, target.offset, target.length)
    lba = (device.region_offset + target.offset) // device.logical_block_size
    assert (f"expert 3 of layer 1 (experts region bytes {target.offset}..{target.offset + target.length}, "
            f"LBA {lba} (byte {device.region_offset + target.offset}) of {node})") in found.message
    assert any(d.file == EXPERTS_DEVICE and "SHA-256" in d.message and "damaged parts" in d.message
               for d in report.damage)
    result = _cli(pack)
    assert result.returncode == 1 and "expert 3 of layer 1" in result.stdout + result.stderr
