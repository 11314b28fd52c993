"""Start and stop: the startup line, the socket file, and a clean exit on SIGTERM."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

from tests.daemon.conftest import DaemonProcess
from tests.daemon.wire import WireClient


def test_sigterm_without_a_grace_period_ends_running_requests_with_shutdown_and_removes_the_socket(start_daemon):
    # The drain with a grace period: tests/systemd. A batch of one keeps "queued" waiting in the
    # queue (in a batch of two it could finish its 5 tokens before the signal is handled).
    daemon = start_daemon("--shutdown-grace-s", "0", "--max-batch", "1")
    with WireClient(daemon.socket_path) as client:
        client.hello()
        client.ask("long", max_tokens=3000)
        client.ask("queued", max_tokens=5)
        assert client.recv()["event"] == "token"
        daemon.proc.send_signal(signal.SIGTERM)
        ends = client.ends_until_closed()
    assert {rid: (e["event"], e["code"]) for rid, e in ends.items()} == {
        "long": ("error", "shutdown"), "queued": ("error", "shutdown")}
    returncode, stderr = daemon.terminate()
    assert returncode == 0, stderr
    assert not daemon.socket_path.exists()
    assert stderr.splitlines()[-1] == "colibrid: stopped"


def test_sigint_stops_it_too(start_daemon):
    daemon = start_daemon()
    daemon.proc.send_signal(signal.SIGINT)
    assert daemon.proc.wait(20) == 0
    assert not daemon.socket_path.exists()


def test_startup_logs_one_line_saying_what_where_and_how_to_stop(start_daemon, demo_pack):
    daemon = start_daemon()
    _, stderr = daemon.terminate()
    # Only a change made to the machine (vm.nr_hugepages raised for the cache) may come first.
    lines = [line for line in stderr.splitlines() if not line.startswith("colibrid: vm.nr_hugepages: ")]
    first = lines[0]
    assert first.startswith("colibrid: serving demo (")
    assert "params" in first and "active" in first
    assert f"from {demo_pack} on {daemon.socket_path}" in first
    assert "stop with Ctrl-C or SIGTERM" in first


def test_a_stale_socket_file_is_replaced(start_daemon, socket_dir):
    stale_path = socket_dir / "run" / "colibrid.sock"
    stale_path.parent.mkdir()
    left_behind = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left_behind.bind(str(stale_path))  # bound but never listening, then closed: what a crash leaves
    left_behind.close()
    daemon = start_daemon()
    with WireClient(daemon.socket_path) as client:
        assert client.hello()["event"] == "hello"


def test_a_live_daemon_on_the_socket_is_not_taken_over(start_daemon, demo_pack):
    first = start_daemon()
    second = subprocess.run([sys.executable, "-m", "colibrid", "--model", str(demo_pack),
                             "--socket", str(first.socket_path)], capture_output=True, text=True, timeout=60)
    assert second.returncode == 1
    assert second.stderr.splitlines()[-1] == (
        f"colibrid: another colibrid is already serving on {first.socket_path}; stop it first "
        "(or choose another --socket)")
    with WireClient(first.socket_path) as client:  # the first one is untouched
        assert client.hello()["event"] == "hello"


def test_the_socket_directory_is_created(demo_pack, socket_dir):
    daemon = DaemonProcess(demo_pack, socket_dir / "a" / "b" / "colibrid.sock")
    try:
        with WireClient(daemon.socket_path) as client:
            assert client.hello()["event"] == "hello"
    finally:
        assert daemon.terminate()[0] == 0


def test_a_directory_that_is_not_a_pack_fails_at_start_with_one_line(socket_dir):
    not_a_pack = socket_dir / "empty.pack"
    not_a_pack.mkdir()
    result = subprocess.run([sys.executable, "-m", "colibrid", "--model", str(not_a_pack),
                             "--socket", str(socket_dir / "s.sock")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"colibrid: cannot load the model: {not_a_pack} is not a Colibri pack (no manifest.json); "
        "convert a checkpoint with colibri-convert"]
    assert not (socket_dir / "s.sock").exists()
