"""colibri-openai run as a real subprocess, in front of a real colibrid or of a scripted fake."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.colibrictl.fake_daemon import FakeDaemon
from tests.daemon.conftest import DaemonProcess
from tests.daemon.wire import stop_process

START_TIMEOUT_S = 20.0


class GatewayProcess:
    """`python -m colibrid.gateway --listen 127.0.0.1:0`; the port it got is read from its log."""

    def __init__(self, socket_path: Path | str, *flags: str, env: dict[str, str] | None = None) -> None:
        self.argv = [sys.executable, "-m", "colibrid.gateway", "--socket", str(socket_path),
                     "--listen", "127.0.0.1:0", *flags]
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.log: list[str] = []
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError(f"colibri-openai exited ({self.proc.wait()}): {''.join(self.log)}")
            self.log.append(line)
            served = re.search(r"serving on (127\.0\.0\.1:\d+)", line)
            if served:
                self.url = f"http://{served.group(1)}"
                return
        raise RuntimeError(f"colibri-openai did not start: {''.join(self.log)}")

    def stop(self, timeout_s: float = 20.0) -> tuple[int, str]:
        returncode, rest = stop_process(self.proc, timeout_s)
        return returncode, "".join(self.log) + rest


@pytest.fixture
def short_dir():
    """A short temp dir: Unix socket paths must fit in 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="colibri-gw-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def start_gateway():
    started: list[GatewayProcess] = []

    def start(socket_path, *flags: str, env: dict[str, str] | None = None) -> GatewayProcess:
        gateway = GatewayProcess(socket_path, *flags, env=env)
        started.append(gateway)
        return gateway

    yield start
    for gateway in started:
        if gateway.proc.poll() is None:
            gateway.stop()


@pytest.fixture
def fake_daemon(short_dir):
    """fake_daemon(ask_script, status=..., models=...) -> a started FakeDaemon on short_dir/fake.sock."""
    started: list[FakeDaemon] = []

    def start(ask_script=None, status: dict | None = None, models: list[dict] | None = None) -> FakeDaemon:
        daemon = FakeDaemon(str(short_dir / f"fake{len(started)}.sock"), ask_script, status,
                            models or [{"name": "fake-moe", "architecture": "qwen3_moe"}]).start()
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()


@pytest.fixture(scope="module")
def demo_daemon(demo_pack):
    """colibrid on the demo pack, with room in its queue for the load test's 32 requests."""
    directory = Path(tempfile.mkdtemp(prefix="colibri-gw-"))
    daemon = DaemonProcess(demo_pack, directory / "colibrid.sock", "--max-queue", "64")
    yield daemon
    daemon.terminate()
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def demo_gateway(demo_daemon):
    gateway = GatewayProcess(demo_daemon.socket_path)
    yield gateway
    gateway.stop()
