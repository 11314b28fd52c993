"""Socket activation: the socket systemd passes (LISTEN_FDS/LISTEN_PID) is served, and left in place."""

from __future__ import annotations

import shutil
import signal
import time

import pytest

from tests.daemon.wire import WireClient, wait_for_socket

pytestmark = pytest.mark.skipif(shutil.which("systemd-socket-activate") is None,
                                reason="systemd-socket-activate is not installed")


def test_an_inherited_socket_is_served_instead_of_the_configured_path(start_service, work_dir):
    activated = work_dir / "activated.sock"
    # systemd-socket-activate binds the socket, and on the first connection execs colibrid in
    # its own place with LISTEN_FDS=1 and LISTEN_PID set: exactly what systemd does.
    service = start_service(prefix=["systemd-socket-activate", "-l", str(activated)])
    deadline = time.monotonic() + 10
    while not activated.exists() and time.monotonic() < deadline:  # systemd-socket-activate binding it
        time.sleep(0.01)
    # The first connection waits in the backlog while the model loads: the socket is never refused.
    with WireClient(activated, timeout_s=60) as client:
        assert client.hello()["event"] == "hello"
        client.send({"op": "status", "id": "s"})
        status = client.recv()
    assert status["listening"] == [{"address": str(activated), "inherited": True}]
    assert not (work_dir / "colibrid.sock").exists(), "the configured path must not be bound as well"

    service.proc.send_signal(signal.SIGTERM)
    assert service.proc.wait(20) == 0
    returncode, stderr = service.stop()
    assert f"on {activated} (from systemd)" in stderr
    assert activated.exists(), "the socket belongs to systemd: colibrid must not remove it"


def test_fds_meant_for_another_process_are_not_taken(start_service, work_dir):
    # LISTEN_PID names someone else (say our parent): bind the configured path as usual.
    service = start_service(env={"LISTEN_FDS": "1", "LISTEN_PID": "1"})
    wait_for_socket(work_dir / "colibrid.sock", service.proc)
    with WireClient(work_dir / "colibrid.sock") as client:
        assert client.hello()["event"] == "hello"
    assert service.stop()[0] == 0
