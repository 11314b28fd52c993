"""colibrid as systemd sees it: started with NOTIFY_SOCKET / WATCHDOG_USEC / LISTEN_FDS set as
systemd sets them, signalled as systemd signals it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.daemon.wire import stop_process
from tests.systemd.notify_socket import NotifySocket


@pytest.fixture
def work_dir():
    """A short temp dir (Unix socket paths must fit in 107 bytes), readable by other users."""
    path = Path(tempfile.mkdtemp(prefix="colibrid-sd-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def notify_socket(work_dir):
    receiver = NotifySocket(work_dir / "notify.sock")
    yield receiver
    receiver.close()


class Service:
    """colibrid run the way systemd runs it: its environment given, stderr kept for the end."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.argv = argv
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=env)

    def stop(self, timeout_s: float = 30.0) -> tuple[int, str]:
        return stop_process(self.proc, timeout_s)


@pytest.fixture
def start_service(demo_pack, work_dir):
    """start_service(*flags, env={...}, prefix=[...]) -> Service; the socket is work_dir/colibrid.sock."""
    started: list[Service] = []

    def start(*flags: str, env: dict[str, str] | None = None, prefix: list[str] | None = None) -> Service:
        base = {k: v for k, v in os.environ.items()
                if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID",
                             "JOURNAL_STREAM")}
        argv = [*(prefix or []), sys.executable, "-m", "colibrid", "--model", str(demo_pack),
                "--socket", str(work_dir / "colibrid.sock"), "--hugepage-record", str(work_dir / "hugepages.json"),
                *flags]  # (the hugepages a test daemon raises are written down here, not in the machine's record)
        service = Service(argv, {**base, "PYTHONUNBUFFERED": "1", **(env or {})})
        started.append(service)
        return service

    yield start
    for service in started:
        if service.proc.poll() is None:
            service.stop()
