"""colibrictl as people run it — a subprocess against a fake daemon: where the prompt comes
from, what reaches the daemon, what stdout shows and when, and what the exit code says."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import threading
import time

import pytest

from tests.colibrictl.conftest import REPO_ROOT, cli_command, cli_env, run_cli
from tests.colibrictl.fake_daemon import USAGE, answer, endless, fail


def _read_until(stream, needle: bytes, timeout_s: float) -> bytes:
    """Read a pipe until ``needle`` has appeared (or the time is up); return what was read."""
    data = b""
    deadline = time.monotonic() + timeout_s
    while needle not in data and time.monotonic() < deadline:
        ready, _, _ = select.select([stream], [], [], max(0.0, deadline - time.monotonic()))
        if ready:
            chunk = os.read(stream.fileno(), 4096)
            if not chunk:
                break
            data += chunk
    return data


def _wait_for(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


# ---- the prompt -------------------------------------------------------------------------------


def test_prompt_from_the_argument(fake_daemon, socket_path):
    result = run_cli("--socket", socket_path, "ask", "What is 2+2?")

    assert result.returncode == 0, result.stderr
    assert result.stdout == b"Hello, world\n"
    assert result.stderr == b""
    (ask,) = fake_daemon.requests_with("ask")
    assert ask["prompt"] == "What is 2+2?"
    assert fake_daemon.requests[0]["op"] == "hello"  # hello comes first, always


def test_prompt_from_stdin_with_a_system_prompt(fake_daemon, socket_path):
    notes = "line one\nline two — ünïcode\n".encode()

    result = run_cli("--socket", socket_path, "ask", "--system", "Summarize this", stdin=notes)

    assert result.returncode == 0, result.stderr
    (ask,) = fake_daemon.requests_with("ask")
    assert ask["prompt"] == "line one\nline two — ünïcode"  # less the final newline only
    assert ask["system"] == "Summarize this"


def test_echo_asks_what_the_argument_asks(fake_daemon, socket_path):
    """echo's newline is not part of the question: a raw prompt ending in one is continued
    differently."""
    run_cli("--socket", socket_path, "ask", "--raw", stdin=b"class Stack:\n")
    run_cli("--socket", socket_path, "ask", "--raw", "class Stack:")

    from_stdin, from_argument = fake_daemon.requests_with("ask")
    assert from_stdin["prompt"] == from_argument["prompt"] == "class Stack:"


@pytest.mark.parametrize("stdin, prompt", [
    (b"a\r\n", "a"),  # a Windows editor's line end is one newline too
    (b"a\n\n", "a\n"),  # a blank line written on purpose stays
    (b"a", "a"),  # nothing to drop
])
def test_only_one_final_newline_is_dropped(fake_daemon, socket_path, stdin, prompt):
    run_cli("--socket", socket_path, "ask", stdin=stdin)

    assert fake_daemon.requests_with("ask")[0]["prompt"] == prompt


def test_stdin_verbatim_sends_the_exact_text(fake_daemon, socket_path):
    result = run_cli("--socket", socket_path, "ask", "--stdin-verbatim", stdin=b"class Stack:\n")

    assert result.returncode == 0, result.stderr
    assert fake_daemon.requests_with("ask")[0]["prompt"] == "class Stack:\n"


def test_an_empty_prompt_is_a_usage_error(fake_daemon, socket_path):
    result = run_cli("--socket", socket_path, "ask", stdin=b"  \n")

    assert result.returncode == 2
    assert b"prompt is empty" in result.stderr
    assert fake_daemon.requests == []  # no daemon needed to refuse it


def test_unknown_options_are_usage_errors(socket_path):
    assert run_cli("--socket", socket_path, "ask", "--no-such-option", "x").returncode == 2
    assert run_cli("--socket", socket_path, "frobnicate").returncode == 2


def test_help_documents_the_exit_codes():
    result = run_cli("--help")

    assert result.returncode == 0
    for documented in (b"0 ", b"1 ", b"2 ", b"69 ", b"76 ", b"130 ", b"COLIBRI_SOCKET",
                       b"/run/colibri/colibrid.sock", b"ends with a newline"):
        assert documented in result.stdout


def test_help_documents_stdin_and_the_cancelled_line():
    text = b" ".join(run_cli("ask", "--help").stdout.split())  # argparse wraps lines anywhere

    for documented in (b"One final newline of stdin is dropped", b"--stdin-verbatim",
                       b'{"event": "cancelled", "id", "text", "generated_tokens"}'):
        assert documented in text


# ---- what reaches the daemon ------------------------------------------------------------------


def test_generation_options_reach_the_daemon_with_protocol_names(fake_daemon, socket_path):
    result = run_cli(
        "--socket", socket_path, "ask", "hi", "--max-tokens", "7", "--temperature", "0.5",
        "--top-k", "40", "--top-p", "0.9", "--min-p", "0.05", "--repeat-penalty", "1.1",
        "--seed", "42", "--stop", "END", "--stop", "\n\n", "--logprobs", "3", "--raw",
    )

    assert result.returncode == 0, result.stderr
    (ask,) = fake_daemon.requests_with("ask")
    assert ask["stop"] == ["END", "\n\n"]  # repeatable, sent as a list
    assert {key: ask[key] for key in ask if key not in ("op", "id", "prompt", "stop")} == {
        "max_tokens": 7, "temperature": 0.5, "top_k": 40, "top_p": 0.9, "min_p": 0.05,
        "repetition_penalty": 1.1, "seed": 42, "logprobs": 3, "raw": True,
    }


def test_options_not_given_are_not_sent(fake_daemon, socket_path):
    run_cli("--socket", socket_path, "ask", "hi")

    (ask,) = fake_daemon.requests_with("ask")
    assert set(ask) == {"op", "id", "prompt"}  # the daemon's defaults apply


# ---- what stdout shows, and when --------------------------------------------------------------


def test_tokens_are_written_as_they_arrive(fake_daemon, socket_path):
    # The daemon holds back the second token until the test has *seen* the first on stdout:
    # a client that buffered its output would never show it, and the read would time out.
    gate = threading.Event()
    fake_daemon.ask_script = answer("first ", "second ", "third", delay_s=0.02, gates={1: gate})
    process = subprocess.Popen(cli_command("--socket", socket_path, "ask", "hi"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env=cli_env(), cwd=REPO_ROOT)
    try:
        before_gate = _read_until(process.stdout, b"first ", timeout_s=5)
        gate.set()
        rest, errors = process.communicate(timeout=10)
    finally:
        gate.set()
        process.kill() if process.poll() is None else None

    assert before_gate == b"first "
    assert before_gate + rest == b"first second third\n"  # in order, then the final newline
    assert process.returncode == 0, errors


def test_no_stream_prints_the_answer_once_at_the_end(fake_daemon, socket_path):
    result = run_cli("--socket", socket_path, "ask", "hi", "--no-stream")

    assert result.returncode == 0, result.stderr
    assert result.stdout == b"Hello, world\n"


def test_no_extra_newline_when_the_answer_ends_with_one(fake_daemon, socket_path):
    fake_daemon.ask_script = answer("a line\n")
    assert run_cli("--socket", socket_path, "ask", "hi").stdout == b"a line\n"


def test_an_empty_answer_prints_nothing(fake_daemon, socket_path):
    fake_daemon.ask_script = answer()
    result = run_cli("--socket", socket_path, "ask", "hi")

    assert result.returncode == 0
    assert result.stdout == b""


def test_json_writes_one_object_per_event(fake_daemon, socket_path):
    result = run_cli("--socket", socket_path, "ask", "hi", "--json", "--logprobs", "1")

    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.decode().splitlines()]
    assert [event["event"] for event in events] == ["token", "token", "token", "done"]
    assert [event["text"] for event in events[:3]] == ["Hello", ",", " world"]
    assert [event["token_ids"] for event in events[:3]] == [[10], [11], [12]]
    assert all(event["logprob"] == -0.25 and event["top_logprobs"] for event in events[:3])
    assert events[3]["finish_reason"] == "stop"
    assert events[3]["text"] == "Hello, world"
    assert events[3]["usage"] == USAGE


def test_json_also_accepted_before_the_command(fake_daemon, socket_path):
    result = run_cli("--json", "--socket", socket_path, "ask", "hi", "--no-stream")

    events = [json.loads(line) for line in result.stdout.decode().splitlines()]
    assert [event["event"] for event in events] == ["done"]


# ---- abandoning a request: closed stdout, Ctrl-C ----------------------------------------------


def test_closed_stdout_exits_quietly_and_cancels(fake_daemon, socket_path, socket_dir):
    fake_daemon.ask_script = endless(delay_s=0.005)
    errors_path = os.path.join(socket_dir, "stderr")
    command = " ".join(cli_command("--socket", socket_path, "ask", "hi"))
    pipeline = f"{command} 2>{errors_path} | head -c 20"

    # pipefail: the pipeline's status is colibrictl's, not head's.
    result = subprocess.run(["bash", "-o", "pipefail", "-c", pipeline], capture_output=True,
                            env=cli_env(), cwd=REPO_ROOT, timeout=10)

    assert result.returncode == 0
    assert result.stdout == b"word0 word1 word2 wo"
    with open(errors_path, "rb") as errors:
        assert errors.read() == b""  # no traceback, no "Broken pipe"
    assert fake_daemon.cancel_received.wait(timeout=5)
    (ask,) = fake_daemon.requests_with("ask")
    assert fake_daemon.requests_with("cancel")[0]["target"] == ask["id"]


def test_ctrl_c_cancels_and_exits_130(fake_daemon, socket_path):
    fake_daemon.ask_script = endless(delay_s=0.005)
    # Python keeps SIGINT ignored if its parent ignored it (a background job): undo that here,
    # so the test does not depend on how pytest itself was started.
    process = subprocess.Popen(cli_command("--socket", socket_path, "ask", "hi"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(),
                               cwd=REPO_ROOT,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert b"word1" in _read_until(process.stdout, b"word1", timeout_s=5)
        process.send_signal(signal.SIGINT)
        _, errors = process.communicate(timeout=10)
    finally:
        process.kill() if process.poll() is None else None

    assert process.returncode == 130
    assert errors == b""
    assert fake_daemon.cancel_received.wait(timeout=5)
    (ask,) = fake_daemon.requests_with("ask")
    assert fake_daemon.requests_with("cancel")[0]["target"] == ask["id"]


def test_ctrl_c_in_json_mode_ends_with_a_cancelled_line(fake_daemon, socket_path):
    """A pipeline reading --json tells an answer cut by Ctrl-C from a complete one by its
    last line, which carries what had arrived."""
    fake_daemon.ask_script = endless(delay_s=0.005)
    process = subprocess.Popen(cli_command("--socket", socket_path, "ask", "hi", "--json"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(),
                               cwd=REPO_ROOT,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        before = _read_until(process.stdout, b"word1", timeout_s=5)
        process.send_signal(signal.SIGINT)
        rest, errors = process.communicate(timeout=10)
    finally:
        process.kill() if process.poll() is None else None

    assert process.returncode == 130
    assert errors == b""
    events = [json.loads(line) for line in (before + rest).decode().splitlines()]
    *tokens, last = events
    (ask,) = fake_daemon.requests_with("ask")
    assert {event["event"] for event in tokens} == {"token"}
    assert last == {"event": "cancelled", "id": ask["id"], "generated_tokens": len(tokens),
                    "text": "".join(event["text"] for event in tokens)}
    assert fake_daemon.cancel_received.wait(timeout=5)


# ---- failures ---------------------------------------------------------------------------------


def test_no_daemon_exits_69_naming_the_socket(socket_dir):
    missing = os.path.join(socket_dir, "nobody-here.sock")

    result = run_cli("--socket", missing, "ask", "hi")

    assert result.returncode == 69
    message = result.stderr.decode()
    assert missing in message
    assert "systemctl start colibrid" in message
    assert "colibrid --model PACK --socket PATH" in message
    assert "Traceback" not in message


def test_a_socket_nobody_listens_on_exits_69(socket_dir):
    stale = os.path.join(socket_dir, "stale.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as leftover:
        leftover.bind(stale)  # bound, never listening: what a crashed daemon leaves behind
        result = run_cli("--socket", stale, "status")

    assert result.returncode == 69
    assert stale in result.stderr.decode()
    assert "refused" in result.stderr.decode()


@pytest.mark.parametrize("kind", ["directory", "regular file"])
def test_a_socket_path_that_is_no_socket_is_named_as_such(socket_dir, kind):
    path = os.path.join(socket_dir, "colibrid.sock")
    if kind == "directory":
        os.mkdir(path)
    else:
        open(path, "w").close()

    result = run_cli("--socket", path, "status")

    assert result.returncode == 69
    message = result.stderr.decode()
    assert f"{path}: that is a {kind}, not a socket" in message
    assert "refused" not in message


def test_a_request_error_exits_1_with_its_code(fake_daemon, socket_path):
    fake_daemon.ask_script = fail("invalid_params", "temperature must be >= 0")

    result = run_cli("--socket", socket_path, "ask", "hi", "--temperature", "-1")

    assert result.returncode == 1
    assert result.stderr == b"colibrictl: error [invalid_params]: temperature must be >= 0\n"


def test_an_error_mid_answer_still_ends_the_line(fake_daemon, socket_path):
    def tokens_then_failure(reply, request):
        reply.token("partial answer")
        reply.error("engine", "expert checksum mismatch at layer 3")

    fake_daemon.ask_script = tokens_then_failure

    result = run_cli("--socket", socket_path, "ask", "hi")

    assert result.returncode == 1
    assert result.stdout == b"partial answer\n"
    assert result.stderr == b"colibrictl: error [engine]: expert checksum mismatch at layer 3\n"


def test_a_prompt_over_the_daemons_frame_limit_is_refused_by_the_client(fake_daemon, socket_path):
    result = run_cli("--socket", socket_path, "ask", stdin=b"x" * (2 << 20))  # limit: 1 MiB

    assert result.returncode == 1
    assert result.stderr.startswith(b"colibrictl: error [frame_too_large]: ")
    assert fake_daemon.requests_with("ask") == []


def test_a_request_error_in_json_mode_is_also_a_json_line(fake_daemon, socket_path):
    fake_daemon.ask_script = fail("busy", "the queue is full")

    result = run_cli("--socket", socket_path, "ask", "hi", "--json")

    assert result.returncode == 1
    (event,) = [json.loads(line) for line in result.stdout.decode().splitlines()]
    assert event["event"] == "error" and event["code"] == "busy"


def test_a_daemon_that_breaks_the_protocol_exits_76(socket_path):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(socket_path)
        server.listen(1)

        def talk_nonsense():
            connection, _ = server.accept()
            with connection:
                connection.recv(4096)
                connection.sendall(b"\x00\x00\x00\x03abc")  # a frame that is not a map

        thread = threading.Thread(target=talk_nonsense, daemon=True)
        thread.start()
        result = run_cli("--socket", socket_path, "status")
        thread.join(timeout=5)

    assert result.returncode == 76
    assert b"protocol error" in result.stderr


# ---- choosing the socket ----------------------------------------------------------------------


def test_colibri_socket_environment_variable(fake_daemon, socket_path):
    result = run_cli("ask", "hi", env=cli_env(COLIBRI_SOCKET=socket_path))

    assert result.returncode == 0, result.stderr
    assert fake_daemon.requests_with("ask")


def test_socket_option_wins_over_the_environment(fake_daemon, socket_path, socket_dir):
    elsewhere = os.path.join(socket_dir, "elsewhere.sock")

    result = run_cli("--socket", socket_path, "ask", "hi", env=cli_env(COLIBRI_SOCKET=elsewhere))

    assert result.returncode == 0, result.stderr


def test_the_default_socket_is_named_when_unreachable():
    if os.path.exists("/run/colibri/colibrid.sock"):
        pytest.skip("a real daemon is installed here")
    result = run_cli("status")

    assert result.returncode == 69
    assert "/run/colibri/colibrid.sock" in result.stderr.decode()


# ---- status and models ------------------------------------------------------------------------

STATUS = {
    "model": "olmoe-1b-7b",
    "path": "/var/lib/colibri/olmoe",
    "architecture": "olmoe",
    "parameters_total": 6_920_000_000,
    "parameters_active": 1_280_000_000,
    "quantization": {"experts": "q4_0", "dense": "f16"},
    "memory": {"rss_bytes": 1_610_612_736, "dense_bytes": 536_870_912, "dense_resident_bytes": 536_870_912,
               "expert_cache_resident_bytes": 1_073_741_824, "expert_cache_in_rss": True, "kv_in_use_bytes": 0,
               "prefix_cache_in_use_bytes": 0, "rest_bytes": 0},
    "cache": {"hits": 900, "misses": 100, "bytes_read": 3_221_225_472},
    "uptime_s": 3725,
    "requests_served": 12,
    "requests_running": 1,
    "queue_depth": 0,
    "queue_limit": 16,
    "version": "colibrid 0.1.0",
}


def test_status_is_an_aligned_table_with_units(fake_daemon, socket_path):
    fake_daemon.status = STATUS

    result = run_cli("--socket", socket_path, "status")

    assert result.returncode == 0, result.stderr
    lines = result.stdout.decode().splitlines()
    rows = {line.split("  ")[0].strip(): line for line in lines}
    assert rows["memory rss"].endswith("1.50 GiB")
    assert rows["memory expert cache resident"].endswith("1.00 GiB")
    assert rows["memory rest"].endswith("0 B")
    assert rows["cache bytes read"].endswith("3.00 GiB")
    assert rows["parameters total"].endswith("6.92 B")
    assert rows["uptime"].endswith("1h 02m 05s")
    assert rows["quantization"].endswith("experts=q4_0, dense=f16")
    assert rows["cache hit rate"].endswith("90.0 %")
    value_columns = {len(line) - len(line[line.index("  "):].lstrip()) for line in lines}
    assert len(value_columns) == 1  # every value starts in the same column


def test_status_json_is_the_raw_map(fake_daemon, socket_path):
    fake_daemon.status = STATUS

    result = run_cli("--socket", socket_path, "status", "--json")

    assert result.returncode == 0, result.stderr
    reply = json.loads(result.stdout)
    assert {key: reply[key] for key in STATUS} == STATUS
    assert reply["event"] == "status"


MODELS = [
    {"name": "olmoe-1b-7b", "path": "/var/lib/colibri/olmoe", "architecture": "olmoe",
     "parameters_total": 6_920_000_000, "parameters_active": 1_280_000_000,
     "quantization": {"experts": "q4_0"}},
    {"name": "qwen3-30b-a3b", "path": "/srv/qwen3", "architecture": "qwen3_moe",
     "parameters_total": 30_500_000_000, "parameters_active": 3_300_000_000,
     "quantization": {"experts": "q4_0", "dense": "q8_0"}},
]


def test_models_is_a_table(fake_daemon, socket_path):
    fake_daemon.models = MODELS

    result = run_cli("--socket", socket_path, "models")

    assert result.returncode == 0, result.stderr
    header, first, second = result.stdout.decode().splitlines()
    assert header.split() == ["NAME", "ARCHITECTURE", "PARAMETERS", "ACTIVE", "QUANTIZATION",
                              "PATH"]
    assert first.startswith("olmoe-1b-7b") and "6.92 B" in first and "1.28 B" in first
    assert second.startswith("qwen3-30b-a3b") and "30.50 B" in second
    assert header.index("ARCHITECTURE") == first.index("olmoe ") == second.index("qwen3_moe")


def test_models_json(fake_daemon, socket_path):
    fake_daemon.models = MODELS

    result = run_cli("--socket", socket_path, "models", "--json")

    assert json.loads(result.stdout)["models"] == MODELS
