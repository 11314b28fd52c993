"""`verify` through a running daemon: progress streamed as events, each finding named, the
damaged record marked so that a request needing it fails with `pack_damaged` while the others
are served; a foreground verify waits while a request runs, a background one keeps to its
bandwidth cap at idle I/O priority; one at a time; a disconnect or a shutdown stops it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.daemon.conftest import DaemonProcess
from tests.daemon.wire import WireClient
from tests.pack.conftest import flip_byte

MAX_TOKENS = 6


def _colibrictl(socket_path, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "colibrictl", "--socket", str(socket_path), *args],
                          capture_output=True, text=True, timeout=timeout_s)


def _status(socket_path) -> dict:
    with WireClient(socket_path) as client:
        client.hello()
        client.send({"op": "status", "id": "s"})
        return client.recv()


def _wait_for(predicate, timeout_s: float = 30.0, every_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError("timed out")


def _experts_used(engine, prompt: str) -> set[tuple[int, int]]:
    """(layer, expert) pairs a greedy answer of MAX_TOKENS to ``prompt`` reads, computed in-process."""
    asked = set()
    acquire = engine.experts.acquire

    def recording(layer, experts):
        asked.update((layer, int(e)) for e in experts)
        return acquire(layer, experts)

    engine.experts.acquire = recording
    engine.greedy(engine.prompt_ids(prompt=prompt, raw=True), MAX_TOKENS)
    engine.experts.acquire = acquire
    return asked


@pytest.fixture
def damaged_daemon(demo_pack, tmp_path, socket_dir):
    """A daemon on a copy of the demo pack with one expert record damaged that one prompt
    needs and another does not: (daemon, record, needing prompt, sparing prompt)."""
    from colibrid.engine import load

    engine = load(demo_pack)
    needing = "def fibonacci(n):" + " return n" * 12
    used = _experts_used(engine, needing)
    rng = np.random.default_rng(0)
    for _ in range(50):
        sparing = "".join(chr(c) for c in rng.integers(97, 123, 3))
        spared = sorted(used - _experts_used(engine, sparing))
        if spared:
            break
    layer, expert = spared[0]
    record = engine.pack.expert_record(layer, expert)
    pack = shutil.copytree(demo_pack, tmp_path / "demo.pack")
    flip_byte(pack / "experts.bin", record.offset + 4000)
    daemon = DaemonProcess(pack, socket_dir / "colibrid.sock")
    yield daemon, record, needing, sparing
    daemon.terminate()


def test_verify_streams_progress_names_the_damage_and_marks_it(damaged_daemon):
    daemon, record, needing, sparing = damaged_daemon
    result = _colibrictl(daemon.socket_path, "verify", "--json")
    assert result.returncode == 65, result.stdout + result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert events[0]["event"] == "verify_progress" and events[0]["bytes_total"] > 0
    damage = [e for e in events if e["event"] == "verify_damage" and "layer" in e]
    assert [(e["layer"], e["expert"], e["offset"], e["file"]) for e in damage] == \
        [(record.layer, record.expert, record.offset, "experts.bin")]
    verified = events[-1]
    assert verified["event"] == "verified" and verified["clean"] is False and verified["files"]["dense.bin"] == "ok"
    last_progress = [e for e in events if e["event"] == "verify_progress"][-1]
    assert last_progress["bytes_done"] == last_progress["bytes_total"] == verified["bytes_read"]

    status = _status(daemon.socket_path)
    assert status["pack_damage"]["records"] == 1
    mark = status["pack_damage"]["shown"][0]
    assert (mark["layer"], mark["expert"], mark["offset"], mark["found_by"]) == \
        (record.layer, record.expert, record.offset, "verify")
    assert status["verify"]["running"] is False and status["verify"]["last"]["damage_found"] == 2  # record, sha256
    shown = _colibrictl(daemon.socket_path, "status")
    assert "pack damage" in shown.stdout and f"layer={record.layer}" in shown.stdout

    with WireClient(daemon.socket_path) as client:
        client.hello()
        client.ask("spared", sparing, max_tokens=MAX_TOKENS)
        client.ask("needing", needing, max_tokens=MAX_TOKENS)
        ends = {rid: end for rid, (_, end) in client.collect_all(["spared", "needing"]).items()}
    assert ends["spared"]["event"] == "done"
    failed = ends["needing"]
    assert failed["event"] == "error" and failed["code"] == "pack_damaged"
    assert failed["damage"]["layer"] == record.layer and failed["damage"]["expert"] == record.expert
    assert f"pack damaged: expert {record.expert} of layer {record.layer}" in failed["message"]
    assert "colibri-verify" in failed["message"]
    # The record was not read again: a load would have found it damaged and marked it so.
    assert [m["found_by"] for m in _status(daemon.socket_path)["pack_damage"]["shown"]] == ["verify"]


def test_a_foreground_verify_waits_while_a_request_runs(start_daemon):
    daemon = start_daemon()
    with WireClient(daemon.socket_path) as asker, WireClient(daemon.socket_path) as verifier:
        asker.hello()
        verifier.hello()
        asker.ask("long", max_tokens=100000, ignore_eos=True)
        assert asker.recv()["event"] == "token"  # it runs
        verifier.send({"op": "verify", "id": "v"})
        first = verifier.recv()
        assert first["event"] == "verify_progress" and first["bytes_done"] == 0
        paused = verifier.recv()
        assert paused["event"] == "verify_progress" and paused["paused"] is True and paused["bytes_done"] == 0
        time.sleep(0.5)
        assert _status(daemon.socket_path)["verify"]["bytes_done"] == 0  # still waiting
        asker.send({"op": "cancel", "id": "c", "target": "long"})
        events = []
        while not events or events[-1]["event"] != "verified":
            events.append(verifier.recv())
    assert events[-1]["clean"] is True and events[-1]["bytes_read"] > 0
    assert any(e["event"] == "verify_progress" and e["paused"] is False for e in events)


def test_a_background_verify_keeps_its_cap_at_idle_io_priority(start_daemon, demo_pack):
    from colibrid import native

    daemon = start_daemon()
    total = sum(p.stat().st_size for p in demo_pack.iterdir() if p.name != "manifest.json")
    cap_mb = total / 1e6 / 2.0  # the pack in about 2 s
    started = time.monotonic()
    result = _colibrictl(daemon.socket_path, "verify", "--background", "--max-mb-per-s", f"{cap_mb:.3f}")
    assert result.returncode == 0 and "background" in result.stderr
    running = _wait_for(lambda: (s := _status(daemon.socket_path)["verify"]).get("thread_id") and s)
    assert running["mode"] == "background" and running["io_priority"] == "idle"
    assert native.get_io_priority(running["thread_id"]) == (native.IoClass.IDLE, 0)
    stat = open(f"/proc/{daemon.proc.pid}/task/{running['thread_id']}/stat").read()
    assert int(stat.rsplit(")", 1)[1].split()[16]) == 19  # its CPU niceness
    busy = _colibrictl(daemon.socket_path, "verify")  # one at a time
    assert busy.returncode == 1 and "busy" in busy.stderr and "already running" in busy.stderr
    last = _wait_for(lambda: _status(daemon.socket_path)["verify"]["last"], timeout_s=60)
    elapsed = time.monotonic() - started
    assert last["clean"] is True and last["bytes_read"] == total
    # Each read starts no earlier than (bytes before it) / cap and is at most 0.25 s worth.
    assert last["seconds"] >= (total / (cap_mb * 1e6)) - 0.3, last
    assert elapsed < 30
    assert last["bytes_read"] / last["seconds"] <= 1.25 * cap_mb * 1e6


def test_a_disconnect_stops_a_foreground_verify_and_a_shutdown_a_background_one(start_daemon):
    daemon = start_daemon()
    with WireClient(daemon.socket_path) as client:
        client.hello()
        client.send({"op": "verify", "id": "v", "max_mb_per_s": 0.5})  # about 20 s
        assert client.recv()["event"] == "verify_progress"
    last = _wait_for(lambda: _status(daemon.socket_path)["verify"]["last"], timeout_s=10)
    assert last["cancelled"] is True and last["mode"] == "foreground"

    assert _colibrictl(daemon.socket_path, "verify", "--background", "--max-mb-per-s", "0.5").returncode == 0
    _wait_for(lambda: _status(daemon.socket_path)["verify"]["running"])
    started = time.monotonic()
    returncode, stderr = daemon.terminate()
    assert returncode == 0 and time.monotonic() - started < 10, stderr
    assert "verify of" in stderr and "stopped" in stderr


@pytest.mark.parametrize("fields, code", [
    ({"background": "yes"}, "bad_request"), ({"stop": 1}, "bad_request"), ({"max_mb_per_s": "9"}, "bad_request"),
    ({"max_mb_per_s": 0}, "invalid_params"), ({"max_mb_per_s": -3.5}, "invalid_params"),
    ({"max_mb_per_s": 1e7}, "invalid_params"),
])
def test_a_verify_request_is_checked(fields, code):
    from colibrid.wire.errors import ProtocolError
    from colibrid.wire.requests import Verify, parse_request

    with pytest.raises(ProtocolError) as info:
        parse_request({"op": "verify", "id": 1, **fields}, 16)
    assert info.value.code == code and info.value.request_id == 1
    assert parse_request({"op": "verify", "id": 2, "background": True, "max_mb_per_s": 12}, 16) == \
        Verify(2, background=True, max_mb_per_s=12.0)


def test_only_root_and_the_daemons_user_may_verify():
    import os

    from colibrid.daemon.access import PeerCredentials, may_administer

    def peer(uid):
        return PeerCredentials(pid=1, uid=uid, gid=uid, groups=frozenset({uid}))

    assert may_administer(peer(0)) and may_administer(peer(os.getuid()))
    assert not may_administer(peer(65534)) and not may_administer(None)
