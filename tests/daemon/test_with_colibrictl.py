"""The product as users meet it: the real colibrictl command line against a real colibrid."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pexpect

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


# ---- colibrictl chat ----------------------------------------------------------------------------

PROMPT_TOKENS = re.compile(r"prompt (\d+) tokens")


def _prompt_tokens_of_each_turn(demo_pack, saved: list[dict]) -> list[int]:
    """What the daemon counts for each turn of a saved conversation (no system prompt) when
    every turn carries all the turns before it: the template applied to them, by the engine."""
    from colibrid.engine import load

    engine = load(demo_pack)
    return [len(engine.prompt_ids(messages=saved[:end])) for end in range(1, len(saved), 2)]


def test_chat_holds_a_three_turn_conversation_under_a_pty(shared_daemon, demo_pack, tmp_path):
    saved = tmp_path / "chat.json"
    command = [sys.executable, "-m", "colibrictl", "--socket", str(shared_daemon.socket_path), "chat",
               "--temperature", "0", "--max-tokens", "6"]
    child = pexpect.spawn(command[0], command[1:], encoding="utf-8", timeout=60,
                          env=dict(os.environ, XDG_STATE_HOME=str(tmp_path), TERM="dumb", INPUTRC=os.devnull))
    child.expect_exact(">>> ")
    prompt_tokens = []
    for question in ("Hello there.", "Tell me more.", "And then?"):
        child.sendline(question)
        child.expect(PROMPT_TOKENS)
        prompt_tokens.append(int(child.match.group(1)))
        child.expect_exact(">>> ")
    child.sendline(f"/save {saved}")
    child.expect_exact(">>> ")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()

    assert child.exitstatus == 0
    conversation = json.loads(saved.read_text())
    assert [m["role"] for m in conversation] == ["user", "assistant"] * 3
    assert [m["content"] for m in conversation[::2]] == ["Hello there.", "Tell me more.", "And then?"]
    # The third turn's prompt held both earlier turns, their answers included, token for token.
    assert prompt_tokens == _prompt_tokens_of_each_turn(demo_pack, conversation)
    assert prompt_tokens[0] < prompt_tokens[1] < prompt_tokens[2]


def test_chat_ctrl_c_frees_the_daemon_and_the_chat_goes_on(shared_daemon, tmp_path):
    command = [sys.executable, "-m", "colibrictl", "--socket", str(shared_daemon.socket_path), "chat",
               "--max-tokens", "100000", "--seed", "1"]
    child = pexpect.spawn(command[0], command[1:], encoding="utf-8", timeout=60,
                          env=dict(os.environ, XDG_STATE_HOME=str(tmp_path), TERM="dumb", INPUTRC=os.devnull),
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    child.expect_exact(">>> ")
    child.sendline("Write a very long story.")
    child.expect_exact("story.\r\n")  # the line as typed, echoed
    child.expect(r"\S")  # the answer is streaming
    time.sleep(0.3)
    child.sendintr()
    child.expect(r"stopped by Ctrl-C after (\d+) tokens")
    assert int(child.match.group(1)) < 100000
    child.expect_exact(">>> ")

    # The generation was cancelled: the engine is idle while the chat waits for the next line.
    deadline = time.monotonic() + 30
    while True:
        with WireClient(shared_daemon.socket_path) as client:
            client.hello()
            client.send({"op": "status", "id": "status"})
            running = client.recv()["requests_running"]
        if running == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert running == 0
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_chat_in_a_pipeline(shared_daemon, demo_pack, tmp_path):
    saved = tmp_path / "chat.json"
    pipeline = (f"printf 'Hello there.\\nTell me more.\\nAnd then?\\n/save {saved}\\n' | "
                f"{sys.executable} -m colibrictl --socket {shared_daemon.socket_path} chat "
                f"--temperature 0 --max-tokens 6 | cat")
    result = subprocess.run(["bash", "-o", "pipefail", "-c", pipeline], capture_output=True, text=True,
                            timeout=120)

    assert result.returncode == 0, result.stderr
    conversation = json.loads(saved.read_text())
    answers = [m["content"] for m in conversation[1::2]]
    assert result.stdout == "".join(a if a.endswith("\n") else a + "\n" for a in answers)  # only the answers
    prompt_tokens = [int(n) for n in PROMPT_TOKENS.findall(result.stderr)]
    assert prompt_tokens == _prompt_tokens_of_each_turn(demo_pack, conversation)
