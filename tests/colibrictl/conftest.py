"""Fixtures for the client tests: a short socket directory, a fake daemon, the CLI as a
subprocess (the way people run it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.colibrictl.fake_daemon import FakeDaemon

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def socket_dir():
    # Not tmp_path: a Unix socket path must fit in 108 bytes, and pytest's can be longer.
    path = tempfile.mkdtemp(prefix="cctl-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def socket_path(socket_dir) -> str:
    return os.path.join(socket_dir, "colibrid.sock")


@pytest.fixture
def fake_daemon(socket_path):
    """A started FakeDaemon; tests replace ``ask_script``, ``status`` or ``models`` freely."""
    daemon = FakeDaemon(socket_path).start()
    yield daemon
    daemon.stop()


def cli_env(**overrides: str) -> dict:
    """The environment of a CLI subprocess: colibrictl importable, no inherited socket."""
    env = dict(os.environ)
    env.pop("COLIBRI_SOCKET", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update(overrides)
    return env


def cli_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "colibrictl", *args]


def run_cli(*args: str, stdin: bytes = b"", env: dict | None = None, timeout: float = 10):
    """Run colibrictl to completion; returns the CompletedProcess (bytes stdout/stderr)."""
    return subprocess.run(cli_command(*args), input=stdin, capture_output=True,
                          env=env or cli_env(), cwd=REPO_ROOT, timeout=timeout)
