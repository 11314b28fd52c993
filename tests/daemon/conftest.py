"""A demo pack built once, and colibrid run as a real subprocess on a socket in a temp dir."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.daemon.wire import stop_process, wait_for_socket


class DaemonProcess:
    def __init__(self, pack: Path, socket_path: Path, *flags: str, preexec_fn=None) -> None:
        """``preexec_fn`` runs in the child before colibrid does (e.g. to enter a cgroup)."""
        self.socket_path = socket_path
        # The hugepages a test daemon raises are written down next to its socket, not in the machine's record.
        self.hugepage_record = socket_path.parent / "hugepages.json"
        self.argv = [sys.executable, "-m", "colibrid", "--model", str(pack), "--socket", str(socket_path),
                     "--hugepage-record", str(self.hugepage_record), *flags]
        # No config file from the machine: the defaults and the flags only.
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                                     preexec_fn=preexec_fn)
        wait_for_socket(socket_path, self.proc)

    def terminate(self, timeout_s: float = 20.0) -> tuple[int, str]:
        """SIGTERM, then the exit code and everything it logged."""
        return stop_process(self.proc, timeout_s)


@pytest.fixture
def socket_dir():
    """A short temp dir: a Unix socket path must fit in 107 bytes, pytest's tmp_path may not."""
    path = Path(tempfile.mkdtemp(prefix="colibrid-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def start_daemon(demo_pack, socket_dir):
    """start_daemon(*flags) -> a running DaemonProcess; every one started is stopped at the end.
    preexec_fn runs in the daemon's process before it starts (to lower a resource limit, say)."""
    started: list[DaemonProcess] = []

    def start(*flags: str, socket_name: str = "colibrid.sock", preexec_fn=None) -> DaemonProcess:
        daemon = DaemonProcess(demo_pack, socket_dir / "run" / socket_name, *flags, preexec_fn=preexec_fn)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        if daemon.proc.poll() is None:
            daemon.terminate()


@pytest.fixture(scope="module")
def shared_daemon(demo_pack):
    """One daemon for the tests that neither stop it nor need special flags."""
    directory = Path(tempfile.mkdtemp(prefix="colibrid-test-"))
    daemon = DaemonProcess(demo_pack, directory / "colibrid.sock")
    yield daemon
    returncode, stderr = daemon.terminate()
    shutil.rmtree(directory, ignore_errors=True)
    assert returncode == 0, f"colibrid exited with {returncode}:\n{stderr}"
