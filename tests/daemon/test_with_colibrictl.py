"""The product as users meet it: the real colibrictl command line against a real colibrid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from tests.daemon.wire import WireClient

EXIT_UNREACHABLE = 69


def _colibrictl(socket_path, *args: str, stdin: str | None = None, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "colibrictl", "--socket", str(socket_path), *args],
                          input=stdin, capture_output=True, text=True, timeout=timeout_s)


def test_greedy_json_output_equals_the_engine(shared_daemon, demo_pack):
    from colibrid.engine import load

    engine = load(demo_pack)
    prompt = "def fibonacci(n):"
    expected = engine.greedy(engine.prompt_ids(prompt=prompt, raw=True), max_tokens=16)

    result = _colibrictl(shared_daemon.socket_path, "ask", "--json", "--raw", "--temperature", "0",
                         "--max-tokens", "16", prompt)
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]  # every line parses
    tokens = [t for e in events if e["event"] == "token" for t in e["token_ids"]]
    done = events[-1]
    assert done["event"] == "done"
    assert tokens == expected[: len(tokens)] and (done["finish_reason"] == "eos" or tokens == expected)


def test_prompt_from_stdin_with_system_prompt(shared_daemon):
    result = _colibrictl(shared_daemon.socket_path, "ask", "--system", "Summarize this", "--max-tokens", "5",
                         "--json", stdin="a long note\nwith two lines\n")
    assert result.returncode == 0, result.stderr
    done = json.loads(result.stdout.splitlines()[-1])
    # The chat template wrapped system + user text: many more tokens than the note alone.
    assert done["event"] == "done" and done["usage"]["prompt_tokens"] > 10


def test_closed_stdout_exits_quietly_and_frees_the_daemon(shared_daemon):
    pipeline = (f"{sys.executable} -m colibrictl --socket {shared_daemon.socket_path} ask --raw "
                f"--max-tokens 3000 'import os' | head -c 20")
    started = time.monotonic()
    # Bytes, not text: head may cut a UTF-8 character in two.
    result = subprocess.run(["bash", "-o", "pipefail", "-c", pipeline], capture_output=True, timeout=120)
    assert result.returncode == 0 and result.stderr == b""
    assert len(result.stdout) <= 20
    # The generation was cancelled on the daemon: the next request runs at once.
    with WireClient(shared_daemon.socket_path) as client:
        client.hello()
        client.ask("next", "x", max_tokens=2)
        _, done = client.collect("next")
    assert done["event"] == "done"
    assert time.monotonic() - started < 60  # 3000 tokens would take far longer if not cancelled


def test_status_table_and_json(shared_daemon):
    table = _colibrictl(shared_daemon.socket_path, "status")
    assert table.returncode == 0 and "demo" in table.stdout
    status = json.loads(_colibrictl(shared_daemon.socket_path, "status", "--json").stdout)
    assert status["model"] == "demo" and status["architecture"] == "olmoe"


def test_daemon_not_running(tmp_path):
    missing = tmp_path / "nobody.sock"
    result = subprocess.run([sys.executable, "-m", "colibrictl", "ask", "hi"], capture_output=True, text=True,
                            env=dict(os.environ, COLIBRI_SOCKET=str(missing)), timeout=30)
    assert result.returncode == EXIT_UNREACHABLE
    assert str(missing) in result.stderr and "colibrid" in result.stderr
