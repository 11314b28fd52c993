"""A pack whose experts live on a raw block device, end to end on loop devices: the default
model converted with colibri-convert --device gives greedily the very tokens of its file-backed
pack (plain reads and the O_DIRECT expert cache, 512- and 4096-byte logical blocks); the
device is found by its superblock under a new name; a device carrying another pack, a damaged
superblock or no device at all are refused at open with the reason."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.blockdev.conftest import MIB, mkfs_ext4

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "models" / "colibri-olmoe-stdlib"
PROMPT_TEXT = "def fibonacci(n):"
GREEDY_TOKENS = 12
DEVICE_BYTES = 32 * MIB  # the default model's experts are ~7 MB


def _convert(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "colibrid.tools.convert.cli", str(MODEL), str(out), "--quiet", *args],
                          capture_output=True, text=True, timeout=300, cwd=REPO)


@pytest.fixture(scope="module")
def file_pack(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("file-pack") / "olmoe.pack"
    assert _convert(out).returncode == 0
    return out


def _greedy(pack_path: Path, cache: bool) -> list[int]:
    from colibrid.engine.engine import Engine
    from colibrid.engine.experts.cache import ExpertCacheSettings
    from colibrid.pack import Pack

    settings = ExpertCacheSettings(cache_size="4M", hugepages="off", lock_memory="off")
    engine = Engine(Pack.open(pack_path), cache=settings if cache else None)
    try:
        session, ids = engine.new_session(), engine.tokenizer.encode(PROMPT_TEXT, add_special_tokens=True)
        tokens = []
        for _ in range(GREEDY_TOKENS):
            logits = session.forward(ids, all_logits=False)
            ids = [int(np.argmax(logits[-1]))]
            tokens.append(ids[0])
        if cache:
            status = engine.cache_status()
            assert status["misses"] > 0 and status["direct"], status  # O_DIRECT reads off the device
        return tokens
    finally:
        engine.close()


@pytest.mark.parametrize("sector_bytes", [512, 4096])
def test_greedy_output_off_the_device_is_the_file_packs(loops, tmp_path, file_pack, sector_bytes):
    node = loops.attach(DEVICE_BYTES, sector_bytes=sector_bytes)
    out = tmp_path / "device.pack"
    result = _convert(out, "--device", str(node))
    assert result.returncode == 0, result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    device = manifest["experts"]["device"]
    assert manifest["format_version"] == 3 and manifest["experts"]["file"] is None and not (out / "experts.bin").exists()
    assert device["logical_block_size"] == sector_bytes and device["identity"]["name"] == node.name
    assert device["region_offset"] == 4096
    expected = _greedy(file_pack, cache=False)
    assert _greedy(out, cache=False) == expected
    assert _greedy(out, cache=True) == expected
    # The records on the device are the file pack's, byte for byte.
    records = (file_pack / "experts.bin").read_bytes()
    with open(node, "rb") as f:
        f.seek(device["region_offset"])
        assert f.read(len(records)) == records


def test_the_device_is_found_by_its_superblock_under_another_name(loops, tmp_path, file_pack):
    from colibrid.pack import Pack

    image = tmp_path / "experts.img"
    node = loops.attach(DEVICE_BYTES, name=image.name)
    out = tmp_path / "device.pack"
    assert _convert(out, "--device", str(node)).returncode == 0
    loops.detach(node)
    loops.attach(DEVICE_BYTES, name="placeholder.img")  # takes the old name, holds nothing
    moved = loops.attach(0, image=image)
    assert moved != node  # the placeholder (or another program) holds the old name
    pack = Pack.open(out)
    assert pack.experts_path == moved
    assert _greedy(out, cache=True) == _greedy(file_pack, cache=False)


def test_a_pack_whose_device_is_gone_is_refused_with_what_to_attach(loops, tmp_path):
    from colibrid.pack import Pack, PackError

    node = loops.attach(DEVICE_BYTES)
    out = tmp_path / "device.pack"
    assert _convert(out, "--device", str(node)).returncode == 0
    pack_id = json.loads((out / "manifest.json").read_text())["experts"]["device"]["pack_id"]
    loops.detach(node)
    with pytest.raises(PackError, match=f"keeps its experts on a raw block device: no block device carries the "
                                        f"Colibri superblock of pack id {pack_id} .*attach the device"):
        Pack.open(out)


def test_a_device_carrying_another_pack_is_refused(loops, tmp_path):
    from colibrid.pack import Pack, PackError

    node = loops.attach(DEVICE_BYTES)
    first, second = tmp_path / "first.pack", tmp_path / "second.pack"
    assert _convert(first, "--device", str(node)).returncode == 0
    refused = _convert(second, "--device", str(node))
    assert refused.returncode == 1 and "--force to replace" in refused.stderr
    assert _convert(second, "--device", str(node), "--force").returncode == 0
    second_id = json.loads((second / "manifest.json").read_text())["experts"]["device"]["pack_id"]
    with pytest.raises(PackError, match=f"{node} carries pack id {second_id}"):
        Pack.open(first)
    Pack.open(second)


def test_a_damaged_superblock_is_no_pack(loops, tmp_path):
    from colibrid.pack import Pack, PackError

    node = loops.attach(DEVICE_BYTES)
    out = tmp_path / "device.pack"
    assert _convert(out, "--device", str(node)).returncode == 0
    with open(node, "r+b") as f:
        f.seek(40)
        f.write(b"\xff")  # the region's first LBA, now without a matching checksum
    with pytest.raises(PackError, match="checksum mismatch"):
        Pack.open(out)


def test_the_command_line_refuses_ext4_and_overwrites_it_when_forced(loops, tmp_path):
    node = loops.attach(DEVICE_BYTES)
    mkfs_ext4(node)
    out = tmp_path / "device.pack"
    refused = _convert(out, "--device", str(node))
    assert refused.returncode == 1 and "--force-overwrite to destroy it" in refused.stderr and not out.exists()
    forced = _convert(out, "--device", str(node), "--force-overwrite")
    assert forced.returncode == 0 and "overwriting ext" in forced.stderr
    if shutil.which("blkid"):
        blkid = subprocess.run(["blkid", "-p", str(node)], capture_output=True, text=True)
        assert blkid.returncode == 2, blkid.stdout  # the wipe left no ext4 signature for blkid to find


def test_a_device_too_small_for_the_experts_is_refused_before_anything_is_written(loops, tmp_path):
    node = loops.attach(2 * MIB)
    out = tmp_path / "device.pack"
    refused = _convert(out, "--device", str(node))
    assert refused.returncode == 1 and "choose a larger partition" in refused.stderr and not out.exists()
    with open(node, "rb") as f:
        assert f.read(4096) == bytes(4096)  # untouched


def test_device_options_without_a_device_are_a_usage_error(tmp_path):
    result = _convert(tmp_path / "x.pack", "--force-overwrite")
    assert result.returncode == 2 and "apply to --device only" in result.stderr


def _daemon_answer(pack: Path, socket_dir: Path) -> list[str]:
    from tests.daemon.conftest import DaemonProcess
    from tests.daemon.wire import WireClient

    daemon = DaemonProcess(pack, socket_dir / "colibrid.sock", "--cache-size", "4M", "--hugepages", "off")
    try:
        with WireClient(daemon.socket_path) as client:
            client.hello()
            client.ask("greedy", max_tokens=8)
            tokens, end = client.collect("greedy")
        assert end["event"] == "done", end
        return [t["text"] for t in tokens]
    finally:
        daemon.terminate()


def test_colibrid_serves_the_device_pack_and_refuses_to_start_without_its_device(loops, tmp_path, file_pack):
    node = loops.attach(DEVICE_BYTES)
    out = tmp_path / "device.pack"
    assert _convert(out, "--device", str(node)).returncode == 0
    socket_dir = Path(tempfile.mkdtemp(prefix="colibrid-rawdev-"))
    try:
        assert _daemon_answer(out, socket_dir) == _daemon_answer(file_pack, socket_dir)
        loops.detach(node)
        result = subprocess.run([sys.executable, "-m", "colibrid", "--model", str(out), "--socket",
                                 str(socket_dir / "s.sock")], capture_output=True, text=True, timeout=60, cwd=REPO)
        assert result.returncode == 1
        assert "cannot load the model: pack" in result.stderr and "no block device carries" in result.stderr
        assert not (socket_dir / "s.sock").exists()
    finally:
        shutil.rmtree(socket_dir, ignore_errors=True)
