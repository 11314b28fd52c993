"""colibrictl chat as people use it: under a pseudo-terminal (typing, Ctrl-C, Ctrl-D, the slash
commands, the history file), and in a pipeline (one answer per line of stdin), against a fake
daemon that records every request, so each test can check the conversation each turn sent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import replace

import pexpect
import pytest

from colibrictl import chat
from colibrictl.conversation import Conversation, ConversationFileError, load, save
from colibrid.wire.events import Usage
from tests.colibrictl.conftest import REPO_ROOT, cli_command, cli_env, run_cli
from tests.colibrictl.fake_daemon import Reply, fail

PROMPT = ">>> "


def echo(reply: Reply, request: dict) -> None:
    """Answers 'reply to QUESTION', in three token events."""
    question = request["messages"][-1]["content"]
    for text in ("reply ", "to ", question):
        reply.token(text)
    reply.done(f"reply to {question}")


def until_cancelled(*texts: str):
    """Streams ``texts``, then waits for the cancel (the daemon's done comes after it)."""

    def script(reply: Reply, request: dict) -> None:
        for text in texts:
            reply.token(text)
        reply.cancelled.wait(timeout=10)
        reply.done("".join(texts), finish_reason="cancelled")

    return script


def in_turn(*scripts):
    """The first ask is answered by scripts[0], the second by scripts[1], ...; later ones echo."""
    count = iter(range(1_000_000))

    def script(reply: Reply, request: dict) -> None:
        index = next(count)
        (scripts[index] if index < len(scripts) else echo)(reply, request)

    return script


@pytest.fixture
def state_dir(tmp_path):
    """$XDG_STATE_HOME of the chat: the history file goes below it, not into the real home."""
    return tmp_path / "state"


@pytest.fixture
def spawn_chat(socket_path, state_dir):
    """spawn_chat(*options) -> pexpect child: `colibrictl chat` on a pseudo-terminal, as typed."""
    children = []

    def spawn(*options: str) -> pexpect.spawn:
        command = cli_command("--socket", socket_path, "chat", *options)
        # TERM=dumb and no inputrc: readline adds no escape sequences (bracketed paste) to the
        # output the test reads. SIGINT default: Python ignores Ctrl-C if its parent did.
        child = pexpect.spawn(command[0], command[1:], cwd=str(REPO_ROOT), encoding="utf-8", timeout=10,
                              env=cli_env(XDG_STATE_HOME=str(state_dir), TERM="dumb", INPUTRC=os.devnull),
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        children.append(child)
        child.expect_exact(PROMPT)
        return child

    yield spawn
    for child in children:
        child.close(force=True)


def say(child: pexpect.spawn, line: str, then: str = PROMPT) -> str:
    """Type a line and Enter; wait for ``then`` (the next prompt); return what was shown."""
    child.sendline(line)
    child.expect_exact(then)
    return child.before


def leave(child: pexpect.spawn) -> int:
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    return child.exitstatus


def wait_for(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(condition())


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


# ---- a conversation ---------------------------------------------------------------------------


def test_three_turns_each_send_the_whole_conversation(fake_daemon, spawn_chat, state_dir):
    fake_daemon.ask_script = echo
    child = spawn_chat("--system", "Be brief", "--temperature", "0", "--seed", "7")

    shown = [say(child, question) for question in ("one", "two", "three")]

    assert leave(child) == 0  # Ctrl-D
    asks = fake_daemon.requests_with("ask")
    assert [ask["messages"] for ask in asks] == [
        [user("one")],
        [user("one"), assistant("reply to one"), user("two")],
        [user("one"), assistant("reply to one"), user("two"), assistant("reply to two"), user("three")],
    ]
    assert all(ask["system"] == "Be brief" and ask["temperature"] == 0 and ask["seed"] == 7 for ask in asks)
    assert "prompt" not in asks[0] and "raw" not in asks[0]
    # Each answer streamed onto its own line, then the status line (the fake's usage).
    assert "reply to three\r\n" in shown[2]
    assert "3 tokens, 41.0 tok/s, prompt 5 tokens, first token 12 ms" in shown[2]
    history = state_dir / "colibri" / "chat_history"
    assert history.read_text().splitlines() == ["one", "two", "three"]
    assert history.stat().st_mode & 0o777 == 0o600


def test_an_answer_is_shown_token_by_token(fake_daemon, spawn_chat):
    gate = threading.Event()

    def slow(reply: Reply, request: dict) -> None:
        reply.token("first-half ")
        gate.wait(timeout=10)
        reply.token("second-half")
        reply.done("first-half second-half")

    fake_daemon.ask_script = slow
    child = spawn_chat()
    child.sendline("go")
    child.expect_exact("first-half ")  # on the screen while the rest is still being generated
    gate.set()
    child.expect_exact("second-half")
    child.expect_exact(PROMPT)


def test_status_line_words():
    usage = Usage(prompt_tokens=311, generated_tokens=42, decode_tokens_per_s=38.12, time_to_first_token_ms=95.4,
                  cached_prompt_tokens=280)
    assert chat.status_line(chat.Answer("x", "eos", usage, 42)) == \
        "42 tokens, 38.1 tok/s, prompt 311 tokens (280 cached), first token 95 ms"
    assert chat.status_line(chat.Answer("x", "length", replace(usage, cached_prompt_tokens=0), 42)) == \
        "42 tokens, 38.1 tok/s, prompt 311 tokens, first token 95 ms, cut at --max-tokens"
    assert chat.status_line(chat.Answer("x", "interrupted", Usage(), 5, decode_s=0.5)) == \
        "stopped by Ctrl-C after 5 tokens, 8.0 tok/s"


# ---- Ctrl-C -----------------------------------------------------------------------------------


def test_ctrl_c_stops_the_answer_and_keeps_what_it_wrote(fake_daemon, spawn_chat):
    fake_daemon.ask_script = in_turn(until_cancelled("word0 ", "word1 ", "word2"))
    child = spawn_chat()
    child.sendline("talk forever")
    child.expect_exact("word2")

    child.sendintr()
    child.expect_exact("stopped by Ctrl-C after 3 tokens")
    child.expect_exact(PROMPT)
    assert fake_daemon.cancel_received.wait(timeout=5)
    (cancel,) = fake_daemon.requests_with("cancel")
    assert cancel["target"] == fake_daemon.requests_with("ask")[0]["id"]

    say(child, "and now?")  # the chat goes on, on a fresh connection
    assert fake_daemon.requests_with("ask")[1]["messages"] == [
        user("talk forever"), assistant("word0 word1 word2"), user("and now?")]
    assert [r["op"] for r in fake_daemon.requests].count("hello") == 2
    assert leave(child) == 0


def test_ctrl_c_before_the_first_token_drops_the_question(fake_daemon, spawn_chat):
    fake_daemon.ask_script = in_turn(until_cancelled())
    child = spawn_chat()
    child.sendline("never answered")
    assert wait_for(lambda: fake_daemon.requests_with("ask"))

    child.sendintr()
    child.expect_exact("question was not added")
    child.expect_exact(PROMPT)
    say(child, "second")

    assert fake_daemon.requests_with("ask")[1]["messages"] == [user("second")]


def test_ctrl_c_at_the_prompt_clears_the_line(fake_daemon, spawn_chat):
    fake_daemon.ask_script = echo
    child = spawn_chat()
    child.send("half a thought")
    child.expect_exact("half a thought")  # echoed: readline has the line
    # A person's Ctrl-C comes while readline waits for a key. (Python's readline misses a
    # SIGINT that lands while it is busy with the key before, until the next key.)
    time.sleep(0.2)
    child.sendintr()
    child.expect_exact(PROMPT)

    say(child, "whole")

    assert fake_daemon.requests_with("ask")[0]["messages"] == [user("whole")]
    assert leave(child) == 0


# ---- commands -----------------------------------------------------------------------------------


def test_save_and_load_round_trip(fake_daemon, spawn_chat, tmp_path):
    fake_daemon.ask_script = echo
    saved = tmp_path / "talk.json"
    child = spawn_chat("--system", "Be brief")
    say(child, "one")
    say(child, "two")

    assert "saved 5 messages" in say(child, f"/save {saved}")
    assert "forgot 2 turns" in say(child, "/reset")
    say(child, "fresh")
    assert "loaded 2 turns" in say(child, f"/load {saved}")
    say(child, "three")

    conversation = [user("one"), assistant("reply to one"), user("two"), assistant("reply to two")]
    assert json.loads(saved.read_text()) == [{"role": "system", "content": "Be brief"}, *conversation]
    asks = fake_daemon.requests_with("ask")
    assert asks[2]["messages"] == [user("fresh")]  # /reset forgot the turns ...
    assert asks[2]["system"] == "Be brief"  # ... not the system prompt
    assert asks[3]["messages"] == [*conversation, user("three")]
    assert asks[3]["system"] == "Be brief"


def test_system_sets_and_removes_the_system_prompt(fake_daemon, spawn_chat):
    fake_daemon.ask_script = echo
    child = spawn_chat()
    say(child, "/system You speak in rhymes.")
    say(child, "one")
    say(child, "/system")
    say(child, "two")

    first, second = fake_daemon.requests_with("ask")
    assert first["system"] == "You speak in rhymes."
    assert "system" not in second and second["messages"][:2] == [user("one"), assistant("reply to one")]


def test_a_bad_file_is_refused_and_the_conversation_stays(fake_daemon, spawn_chat, tmp_path):
    fake_daemon.ask_script = echo
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([user("a"), user("b"), assistant("c")]))
    child = spawn_chat()
    say(child, "one")

    shown = say(child, f"/load {bad}")
    say(child, "two")

    assert "message 2 has role 'user' where 'assistant' was expected" in shown
    assert fake_daemon.requests_with("ask")[1]["messages"] == [user("one"), assistant("reply to one"), user("two")]


def test_help_unknown_commands_and_a_line_that_begins_with_a_slash(fake_daemon, spawn_chat):
    fake_daemon.ask_script = echo
    child = spawn_chat()

    assert "/load FILE" in say(child, "/help")
    assert "unknown command /usr/bin/env" in say(child, "/usr/bin/env is what?")
    say(child, "//usr/bin/env is what?")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()

    assert child.exitstatus == 0
    assert [ask["messages"][-1] for ask in fake_daemon.requests_with("ask")] == [user("/usr/bin/env is what?")]


def test_a_daemon_error_is_shown_and_the_chat_goes_on(fake_daemon, spawn_chat):
    fake_daemon.ask_script = in_turn(fail("busy", "the queue is full"))
    child = spawn_chat()

    shown = say(child, "first")
    say(child, "second")

    assert "error [busy]: the queue is full" in shown
    assert fake_daemon.requests_with("ask")[1]["messages"] == [user("second")]  # the failed turn is not kept


def test_a_daemon_gone_mid_chat_is_reported_and_the_chat_goes_on(socket_path, spawn_chat, tmp_path):
    from tests.colibrictl.fake_daemon import FakeDaemon

    daemon = FakeDaemon(socket_path, ask_script=echo).start()
    child = spawn_chat()
    say(child, "one")
    daemon.stop()

    shown = say(child, "two")
    assert "cannot reach colibrid" in shown
    assert "saved 2 messages" in say(child, f"/save {tmp_path / 'rescued.json'}")  # nothing is lost

    with FakeDaemon(socket_path, ask_script=echo) as restarted:
        say(child, "three")
        assert restarted.requests_with("ask")[0]["messages"] == [user("one"), assistant("reply to one"),
                                                                 user("three")]
    assert leave(child) == 0


def test_the_history_file_keeps_the_newest_lines(fake_daemon, spawn_chat, state_dir):
    fake_daemon.ask_script = echo
    history = state_dir / "colibri" / "chat_history"
    history.parent.mkdir(parents=True)
    history.write_text("".join(f"old line {n}\n" for n in range(chat.HISTORY_LINES + 200)))
    child = spawn_chat()

    child.send("\x10")  # Ctrl-P: the previous line from the history, as Up would
    say(child, "")
    say(child, "fresh")
    assert leave(child) == 0

    newest = chat.HISTORY_LINES + 199
    assert fake_daemon.requests_with("ask")[0]["messages"] == [user(f"old line {newest}")]
    # The newest lines are kept (readline adds no line equal to the one before it).
    lines = history.read_text().splitlines()
    assert len(lines) == chat.HISTORY_LINES
    assert lines[-2:] == [f"old line {newest}", "fresh"]
    assert lines[0] == f"old line {newest - chat.HISTORY_LINES + 2}"


# ---- the conversation file ------------------------------------------------------------------------


@pytest.mark.parametrize("content, complaint", [
    (b"[{\"role\": \"user\",", "is not JSON: line 1 column"),
    (b"\xff\xfe[]", "is not UTF-8 text"),
    (b'{"messages": []}', "holds a JSON object; a conversation is a list"),
    (b'[{"role": "user"}]', 'message 1 is not a map of exactly "role" and "content"'),
    (b'[{"role": "user", "content": "a", "name": "x"}]', "message 1 is not a map of exactly"),
    (b'[{"role": "user", "content": 3}]', 'message 1: "role" and "content" must be strings'),
    (b'[{"role": "assistant", "content": "a"}]', "message 1 has role 'assistant' where 'user' was expected"),
    (b'[{"role": "system", "content": "s"}, {"role": "tool", "content": "t"}]',
     "message 2 has role 'tool' where 'user' was expected"),
    (b'[{"role": "user", "content": "a"}, {"role": "system", "content": "s"}]',
     "a system message may only come first"),
    (b'[{"role": "system", "content": "s"}, {"role": "user", "content": "a"}]',
     "message 2, the last, is a user message without an answer"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
])
def test_load_names_what_is_wrong(tmp_path, content, complaint):
    path = tmp_path / "conversation.json"
    path.write_bytes(content)

    with pytest.raises(ConversationFileError) as raised:
        load(str(path))

    assert str(path) in str(raised.value) and complaint in str(raised.value)


def test_load_refuses_a_missing_or_huge_file(tmp_path, monkeypatch):
    with pytest.raises(ConversationFileError, match="cannot read .*: No such file"):
        load(str(tmp_path / "missing.json"))
    monkeypatch.setattr("colibrictl.conversation.MAX_FILE_BYTES", 10)
    (tmp_path / "big.json").write_text("[" + " " * 20 + "]")
    with pytest.raises(ConversationFileError, match="larger than"):
        load(str(tmp_path / "big.json"))


def test_save_then_load_gives_the_same_conversation(tmp_path):
    conversation = Conversation("sÿstem", [user("ünï\ncode"), assistant(""), user("<|im_start|>"), assistant("b")])
    path = tmp_path / "c.json"

    save(conversation, str(path))

    assert load(str(path)) == conversation
    assert path.stat().st_mode & 0o777 == 0o600
    assert load(str(path)).as_messages()[0] == {"role": "system", "content": "sÿstem"}


def test_a_failed_save_keeps_the_earlier_file(tmp_path):
    path = tmp_path / "c.json"
    save(Conversation(None, [user("a"), assistant("b")]), str(path))
    with pytest.raises(ConversationFileError, match="cannot write"):
        save(Conversation(), str(tmp_path / "no-such-dir" / "c.json"))
    assert load(str(path)).turns == [user("a"), assistant("b")]
    assert [p.name for p in tmp_path.iterdir()] == ["c.json"]  # no temporary file left


# ---- scripts: stdin not a terminal ----------------------------------------------------------------


def test_a_pipeline_gets_one_answer_per_line_and_nothing_else(fake_daemon, socket_path):
    fake_daemon.ask_script = echo

    result = run_cli("--socket", socket_path, "chat", stdin=b"one\n\ntwo\r\nthree")

    assert result.returncode == 0, result.stderr
    assert result.stdout == b"reply to one\nreply to two\nreply to three\n"
    assert result.stderr.count(b"41.0 tok/s") == 3  # the status lines: stderr, not dimmed
    assert b"\033[" not in result.stderr
    assert fake_daemon.requests_with("ask")[2]["messages"] == [
        user("one"), assistant("reply to one"), user("two"), assistant("reply to two"), user("three")]


def test_a_script_gets_each_answer_before_it_writes_the_next_line(fake_daemon, socket_path):
    fake_daemon.ask_script = echo
    process = subprocess.Popen(cli_command("--socket", socket_path, "chat"), stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=cli_env(), cwd=REPO_ROOT)
    try:
        for question in ("one", "two"):
            process.stdin.write(f"{question}\n".encode())
            process.stdin.flush()
            assert process.stdout.readline() == f"reply to {question}\n".encode()  # stdin still open
        process.stdin.close()
        assert process.wait(timeout=10) == 0
    finally:
        process.kill()


def test_an_empty_answer_is_an_empty_line(fake_daemon, socket_path):
    fake_daemon.ask_script = in_turn(lambda reply, request: reply.done(""))

    result = run_cli("--socket", socket_path, "chat", stdin=b"one\ntwo\n")

    assert result.stdout == b"\nreply to two\n"


def test_a_script_stops_at_the_first_error(fake_daemon, socket_path):
    fake_daemon.ask_script = in_turn(echo, fail("thermal", "the drive is too hot"))

    result = run_cli("--socket", socket_path, "chat", stdin=b"one\ntwo\nthree\n")

    assert result.returncode == 1
    assert result.stdout == b"reply to one\n"
    assert b"error [thermal]: the drive is too hot" in result.stderr
    assert len(fake_daemon.requests_with("ask")) == 2


def test_a_script_stops_at_a_line_it_cannot_carry_out(fake_daemon, socket_path, tmp_path):
    fake_daemon.ask_script = echo

    result = run_cli("--socket", socket_path, "chat", stdin=f"one\n/load {tmp_path}/missing.json\ntwo\n".encode())

    assert result.returncode == 2
    assert result.stdout == b"reply to one\n"
    assert b"cannot read" in result.stderr


def test_a_script_can_load_and_save(fake_daemon, socket_path, tmp_path):
    fake_daemon.ask_script = echo
    earlier = tmp_path / "earlier.json"
    save(Conversation("sys", [user("a"), assistant("b")]), str(earlier))

    result = run_cli("--socket", socket_path, "chat",
                     stdin=f"/load {earlier}\nc\n/save {tmp_path}/later.json\n/exit\nnever sent\n".encode())

    assert result.returncode == 0, result.stderr
    assert result.stdout == b"reply to c\n"
    assert load(str(tmp_path / "later.json")).turns == [user("a"), assistant("b"), user("c"), assistant("reply to c")]
    assert len(fake_daemon.requests_with("ask")) == 1


def test_json_gives_each_turns_events(fake_daemon, socket_path):
    fake_daemon.ask_script = echo

    result = run_cli("--socket", socket_path, "chat", "--json", stdin=b"one\ntwo\n")

    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert [e["event"] for e in events] == ["token"] * 3 + ["done"] + ["token"] * 3 + ["done"]
    assert events[-1]["text"] == "reply to two"
    assert result.stderr == b""


def test_no_daemon_exits_69_before_reading_stdin(socket_dir):
    missing = os.path.join(socket_dir, "nobody.sock")

    result = run_cli("--socket", missing, "chat", stdin=b"one\n")

    assert result.returncode == 69
    assert missing.encode() in result.stderr and result.stdout == b""


def test_help_documents_chat():
    text = b" ".join(run_cli("chat", "--help").stdout.split())
    for documented in (b"/system TEXT", b"/reset", b"/save FILE", b"/load FILE", b"/exit", b"Ctrl-C",
                       b"chat_history", b"stdin is not a terminal", b"--temperature", b"--seed"):
        assert documented in text
    assert b"/save FILE" in run_cli("--help").stdout
