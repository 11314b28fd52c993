"""colibrictl gives up on a daemon that does not accept or does not answer hello in time (exit 69),
instead of hanging; once greeted, a request may take as long as it takes."""

from __future__ import annotations

import socket
import time

import pytest

from colibrid.wire.client import Connection
from colibrid.wire.errors import DaemonUnreachable
from tests.colibrictl.conftest import run_cli


@pytest.fixture
def silent_daemon(socket_path):
    """Accepts connections and never says a word."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(socket_path)
    server.listen(8)
    yield server
    server.close()


@pytest.fixture
def full_backlog(socket_path):
    """Listens but never accepts, and its backlog is already full: connect() itself blocks."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(socket_path)
    server.listen(0)
    waiting = []
    for _ in range(4):
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.setblocking(False)
        try:
            client.connect(socket_path)
        except BlockingIOError:
            client.close()
            break
        waiting.append(client)
    yield server
    for client in waiting:
        client.close()
    server.close()


def test_no_answer_to_hello_within_the_timeout(silent_daemon, socket_path):
    started_s = time.monotonic()
    with pytest.raises(DaemonUnreachable, match=r"no answer to hello within 0.3 s"):
        Connection.open(socket_path, "tests", timeout_s=0.3)
    assert time.monotonic() - started_s < 2


def test_not_accepted_within_the_timeout(full_backlog, socket_path):
    started_s = time.monotonic()
    with pytest.raises(DaemonUnreachable, match=r"not accepted within 0.3 s"):
        Connection.open(socket_path, "tests", timeout_s=0.3)
    assert time.monotonic() - started_s < 2


def test_once_greeted_a_request_has_no_timeout(fake_daemon, socket_path):
    with Connection.open(socket_path, "tests", timeout_s=0.3) as connection:
        assert connection._sock.gettimeout() is None


@pytest.mark.parametrize("command", ["status", "models", "ask"])
def test_the_cli_exits_69_naming_the_timeout(silent_daemon, socket_path, command):
    started_s = time.monotonic()
    result = run_cli("--socket", socket_path, "--connect-timeout", "0.5", command, *(["hi"] if command == "ask" else []))
    assert result.returncode == 69, result.stderr
    assert b"no answer to hello within 0.5 s" in result.stderr
    assert time.monotonic() - started_s < 8


def test_the_timeout_is_in_the_help():
    result = run_cli("--help")
    assert b"--connect-timeout" in result.stdout and b"default 10" in result.stdout
