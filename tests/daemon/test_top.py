"""`colibrictl top` against a real daemon: under a pseudo-terminal (panels drawn, resizes, q
quits), and --once --json on packs whose router is healthy or deliberately collapsed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from tests.daemon.conftest import DaemonProcess
from tests.daemon.wire import WireClient
from tests.routing_packs import COLLAPSED_EXPERT, build_routing_pack

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "import os\nimport sys\n\ndef main(argv):\n    for name in argv:\n        print(os.path.basename(name))\n"


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), TERM="xterm-256color", LANG="C.UTF-8", LC_ALL="C.UTF-8")


def _top(socket_path: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "colibrictl", "top", "--socket", str(socket_path), *flags]


class Asker:
    """Asks again and again on its own connection until stopped: the daemon is never idle."""

    def __init__(self, socket_path: Path, **fields) -> None:
        self._socket_path, self._fields = socket_path, fields
        self._stop = threading.Event()
        self.done = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Asker":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        with WireClient(self._socket_path) as client:
            client.hello()
            n = 0
            while not self._stop.is_set():
                client.send({"op": "ask", "id": n, "prompt": PROMPT, **self._fields})
                _, end = client.collect(n)
                assert end["event"] == "done", end
                self.done += 1
                n += 1


@pytest.fixture(scope="module")
def routing_daemons():
    """Daemons on a healthy and on a collapsed pack, by name."""
    directory = Path(tempfile.mkdtemp(prefix="colibrid-top-"))
    daemons = {}
    try:
        for name, collapsed in (("healthy", False), ("collapsed", True)):
            pack = build_routing_pack(directory / name, collapsed)
            daemons[name] = DaemonProcess(pack, directory / f"{name}.sock")
        yield daemons
    finally:
        for daemon in daemons.values():
            daemon.terminate()
        shutil.rmtree(directory, ignore_errors=True)


def _snapshot(daemon: DaemonProcess) -> dict:
    # Temperature 1: varied tokens, so a healthy router's choices vary too. The prompts alone
    # (~30 tokens each) make the window's 32 tokens within the interval.
    with Asker(daemon.socket_path, max_tokens=8, temperature=1.0, ignore_eos=True):
        run = subprocess.run(_top(daemon.socket_path, "--once", "--json", "--interval", "2", "--window", "64"),
                             capture_output=True, text=True, env=_env(), timeout=60)
    assert run.returncode == 0, run.stderr
    (line,) = run.stdout.splitlines()
    return json.loads(line)


def test_a_collapsed_router_is_warned_about(routing_daemons):
    snapshot = _snapshot(routing_daemons["collapsed"])
    assert snapshot["window"]["tokens"] >= 32
    layers = snapshot["layers"]
    assert [layer["layer"] for layer in layers] == [0, 1, 2, 3]
    for layer in layers:
        assert layer["collapsed"] and layer["top_expert"] == COLLAPSED_EXPERT and layer["top_share"] == 1.0
        assert layer["imbalance"] == pytest.approx(16 / 4)  # the most there is: the same 4 experts every time
    assert len(snapshot["warnings"]) == 4 and all("routing collapsed" in w for w in snapshot["warnings"])


def test_a_healthy_router_is_not(routing_daemons):
    snapshot = _snapshot(routing_daemons["healthy"])
    assert snapshot["window"]["tokens"] >= 32
    assert snapshot["warnings"] == []
    for layer in snapshot["layers"]:
        assert not layer["collapsed"] and layer["top_share"] < snapshot["window"]["collapse_share"]
        assert layer["entropy"] > 0.8 and layer["imbalance"] < 2.5
        assert layer["hits"] + layer["misses"] > 0  # the expert cache's counters per layer


def test_top_draws_its_panels_follows_resizes_and_quits_on_q(routing_daemons):
    pexpect = pytest.importorskip("pexpect")
    daemon = routing_daemons["collapsed"]
    with Asker(daemon.socket_path, max_tokens=4, temperature=1.0, ignore_eos=True):
        child = pexpect.spawn(sys.executable, _top(daemon.socket_path, "--interval", "0.3")[1:], env=_env(),
                              dimensions=(30, 110), encoding="utf-8", timeout=30)
        try:
            child.expect("REQUEST")
            child.expect("LAYER")
            child.expect("routing collapsed")
            child.setwinsize(10, 40)  # a small terminal: still drawn, no crash
            child.expect("colibrid collapsed")
            child.setwinsize(40, 150)
            child.expect("heat: tokens per expert")
            child.send("q")
            child.expect(pexpect.EOF)
        finally:
            child.close(force=True)
    assert child.exitstatus == 0, child.before


def test_top_wants_a_terminal_or_once(routing_daemons):
    run = subprocess.run(_top(routing_daemons["healthy"].socket_path), capture_output=True, text=True, env=_env(),
                         stdin=subprocess.DEVNULL, timeout=30)
    assert run.returncode == 2 and "--once or --json" in run.stderr
    run = subprocess.run(_top(routing_daemons["healthy"].socket_path, "--once", "--interval", "0.2"),
                         capture_output=True, text=True, env=_env(), timeout=30)
    assert run.returncode == 0 and "LAYER" in run.stdout and "thermal" in run.stdout
