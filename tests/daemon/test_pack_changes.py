"""A pack's files changing under a running daemon: dense.bin truncated or rewritten in
place (what `cp` over it does) never takes the daemon down, and answers stay the same."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.daemon.conftest import DaemonProcess
from tests.daemon.wire import WireClient


@pytest.fixture
def own_pack(demo_pack, tmp_path):
    """A copy of the demo pack this test may damage (the session's pack is shared)."""
    return shutil.copytree(demo_pack, tmp_path / "demo.pack")


def _answer(socket_path, request_id):
    with WireClient(socket_path) as client:
        client.hello()
        client.ask(request_id, max_tokens=6)
        tokens, end = client.collect(request_id)
    assert end["event"] == "done", end
    return [t["text"] for t in tokens]


def test_dense_bin_truncated_then_rewritten_while_serving(own_pack, socket_dir):
    daemon = DaemonProcess(own_pack, socket_dir / "colibrid.sock")
    try:
        before = _answer(daemon.socket_path, "before")
        dense = own_pack / "dense.bin"
        contents = dense.read_bytes()
        with open(dense, "r+b") as f:
            f.truncate(0)
            assert _answer(daemon.socket_path, "truncated") == before
            f.write(contents)  # the same bytes back, as `cp dense.bin.bak dense.bin` would
        assert _answer(daemon.socket_path, "rewritten") == before
    finally:
        returncode, stderr = daemon.terminate()
    assert returncode == 0, stderr


def test_pack_without_dense_checksums_is_served_and_status_says_so(own_pack, socket_dir):
    manifest_path = own_pack / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["format_version"] = 1  # as written before dense checksums existed
    for entry in manifest["dense"]["tensors"].values():
        del entry["crc32c"]
    manifest_path.write_text(json.dumps(manifest))
    daemon = DaemonProcess(own_pack, socket_dir / "colibrid.sock")
    try:
        _answer(daemon.socket_path, "served")
        with WireClient(daemon.socket_path) as client:
            client.hello()
            client.send({"op": "status", "id": "status"})
            status = client.recv()
    finally:
        returncode, stderr = daemon.terminate()
    assert returncode == 0, stderr
    [note] = status["pack_notes"]
    assert "no dense checksums" in note and "re-convert" in note
    assert note in stderr  # logged at start, as a warning
