"""One client cannot hurt the others: what a connection may cost is bounded (docs/protocol.md, Limits)."""

from __future__ import annotations

import resource
import signal
import socket
import struct
import threading
import time

import msgpack
import pytest

from tests.daemon.wire import Closed, WireClient


def frame(message: dict) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def expect_error_then_close(client: WireClient, code: str) -> dict:
    error = client.recv()
    assert error["event"] == "error" and error["code"] == code and error["id"] is None, error
    assert client.is_closed_by_server()
    return error


def timed_hello(daemon) -> float:
    started_s = time.monotonic()
    with WireClient(daemon.socket_path, timeout_s=10) as client:
        assert client.hello()["event"] == "hello"
    return time.monotonic() - started_s


# -- output is bounded per connection ---------------------------------------------------------


def test_a_client_that_pipelines_without_reading_is_read_no_further_and_others_are_served(start_daemon):
    daemon = start_daemon("--max-outbox-bytes", "65536")
    # ~1.4 MB: several times what the kernel's socket buffers and asyncio's read buffer hold
    # together, so the daemon can only have taken it all by reading on while its replies sat unread.
    requests = b"".join(frame({"op": "status", "id": i}) for i in range(60_000))
    sent_bytes = 0
    with WireClient(daemon.socket_path, timeout_s=3) as pipeliner:
        pipeliner.hello()

        def pipeline() -> None:
            nonlocal sent_bytes
            try:
                while sent_bytes < len(requests):
                    sent_bytes += pipeliner.sock.send(requests[sent_bytes:sent_bytes + 65536])
            except OSError:  # the send timed out: the daemon stopped reading us, as it should
                pass

        sender = threading.Thread(target=pipeline)
        sender.start()
        time.sleep(0.5)
        hello_s = timed_hello(daemon)
        sender.join(10)
        with WireClient(daemon.socket_path) as observer:
            observer.hello()
            observer.send({"op": "status", "id": "s"})
            status = observer.recv()
    assert sent_bytes < len(requests)  # it was not read while its replies sat unread
    assert hello_s < 1.0
    assert status["memory"]["rss_bytes"] < 300 << 20


def test_a_client_that_stops_reading_is_closed_and_the_engine_moves_on(start_daemon):
    daemon = start_daemon("--max-outbox-bytes", "65536", "--stalled-client-timeout-s", "1")
    with WireClient(daemon.socket_path) as stalled:
        stalled.hello()
        stalled.ask("long", max_tokens=4000)  # ~16 s of engine time if nobody stops it
        # ~2 kB replies that it leaves unread fill the kernel's buffer and its outbox at once.
        stalled.send_raw(b"".join(frame({"op": "status", "id": i}) for i in range(400)))
        time.sleep(0.2)
        with WireClient(daemon.socket_path) as patient:
            patient.hello()
            started_s = time.monotonic()
            patient.ask("short", max_tokens=2)
            _, done = patient.collect("short")
            waited_s = time.monotonic() - started_s
        time.sleep(1.5)  # the patient's ask ran beside the stalled one; the stalled client's 1 s runs out
        events = []
        try:
            while True:
                events.append(stalled.recv())
        except (Closed, ConnectionResetError):
            pass
    assert done["event"] == "done" and waited_s < 8.0
    assert events[-1]["event"] == "error" and events[-1]["code"] == "slow_client" and events[-1]["id"] is None
    assert {event["event"] for event in events[:-1]} <= {"token", "status"}  # its ask never got to done
    assert len(events) < 400


def test_a_900_kb_id_is_refused_before_any_event_repeats_it(shared_daemon):
    with WireClient(shared_daemon.socket_path) as client:
        client.hello()
        client.ask("7" * 900_000, max_tokens=50)
        error = expect_error_then_close(client, "bad_request")
    assert "256 bytes" in error["message"]


# -- connections are limited and idle ones time out -------------------------------------------


def test_connections_past_max_connections_get_busy_and_are_closed(start_daemon):
    daemon = start_daemon("--max-connections", "3")
    time.sleep(0.3)  # the start-up check's own connections close
    clients = [WireClient(daemon.socket_path) for _ in range(3)]
    try:
        for client in clients:
            client.hello()
        with WireClient(daemon.socket_path, timeout_s=5) as refused:
            error = expect_error_then_close(refused, "busy")
        assert "max_connections" in error["message"]
        clients.pop().close()
        time.sleep(0.2)
        with WireClient(daemon.socket_path, timeout_s=5) as admitted:
            admitted.hello()
            admitted.send({"op": "status", "id": "s"})
            connections = admitted.recv()["connections"]
        assert connections["limit"] == 3 and connections["refused_busy"] == 1
    finally:
        for client in clients:
            client.close()


def test_running_out_of_file_descriptors_is_logged_once_per_interval(start_daemon):
    def few_file_descriptors() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))

    daemon = start_daemon("--max-connections", "1000", preexec_fn=few_file_descriptors)
    clients = []
    try:
        for _ in range(60):  # past ~28 the daemon cannot accept; the rest wait in the backlog
            client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            client.settimeout(2)
            client.connect(str(daemon.socket_path))
            clients.append(client)
        time.sleep(2)
    finally:
        for client in clients:
            client.close()
    time.sleep(0.5)
    assert timed_hello(daemon) < 5  # it accepts again once they are gone
    returncode, stderr = daemon.terminate()
    assert returncode == 0
    assert "Traceback" not in stderr
    reports = [line for line in stderr.splitlines() if "cannot accept connections" in line]
    assert 1 <= len(reports) <= 2, reports
    assert "Too many open files" in reports[0] and "LimitNOFILE" in reports[0]


def test_a_client_that_does_not_say_hello_in_time_is_closed(start_daemon):
    daemon = start_daemon("--hello-timeout-s", "0.5")
    with WireClient(daemon.socket_path, timeout_s=5) as silent:
        expect_error_then_close(silent, "timeout")
    with WireClient(daemon.socket_path, timeout_s=5) as halting:
        halting.send_raw(frame({"op": "hello", "id": 1, "protocol": 1})[:6])  # a hello that never ends
        error = expect_error_then_close(halting, "timeout")
    assert "hello_timeout_s" in error["message"]


@pytest.mark.parametrize("cut", [2, 7], ids=["in-the-prefix", "in-the-body"])
def test_a_frame_that_stalls_half_way_is_a_timeout(start_daemon, cut):
    daemon = start_daemon("--frame-timeout-s", "0.5")
    with WireClient(daemon.socket_path, timeout_s=5) as client:
        client.hello()
        time.sleep(1.0)  # idle between frames is allowed, however long
        client.send({"op": "status", "id": "s"})
        assert client.recv()["event"] == "status"
        client.send_raw(frame({"op": "status", "id": "t"})[:cut])
        error = expect_error_then_close(client, "timeout")
    assert "frame_timeout_s" in error["message"]


# -- oversized numbers are refused or bounded cheaply -----------------------------------------


@pytest.mark.parametrize("max_tokens", [2**32, 2**64 - 1])
def test_a_huge_max_tokens_ends_at_the_context(start_daemon, max_tokens):
    daemon = start_daemon("--max-context", "24")
    with WireClient(daemon.socket_path) as client:
        client.hello()
        client.ask("big", max_tokens=max_tokens)
        tokens, done = client.collect("big")
    assert done["event"] == "done" and done["finish_reason"] in ("context", "eos"), done
    assert done["usage"]["prompt_tokens"] + done["usage"]["generated_tokens"] <= 25


def test_a_denormal_temperature_gives_the_greedy_tokens(shared_daemon):
    with WireClient(shared_daemon.socket_path) as client:
        client.hello()
        client.ask("greedy", max_tokens=12, temperature=0)
        greedy, _ = client.collect("greedy")
        client.ask("denormal", max_tokens=12, temperature=1e-310, seed=7)
        denormal, _ = client.collect("denormal")
    assert [t["token_ids"] for t in denormal] == [t["token_ids"] for t in greedy]


def test_the_limits_are_reloadable_and_shown_in_status(start_daemon, socket_dir):
    config = socket_dir / "colibrid.toml"
    config.write_text("max_connections = 3\nhello_timeout_s = 4.0\n")
    daemon = start_daemon("--config", str(config))
    config.write_text("max_connections = 5\nhello_timeout_s = 2.5\nmax_outbox_bytes = 65536\n")
    daemon.proc.send_signal(signal.SIGHUP)
    deadline_s = time.monotonic() + 10
    while True:
        with WireClient(daemon.socket_path) as client:
            client.hello()
            client.send({"op": "status", "id": "s"})
            status = client.recv()
        if status["connections"]["limit"] == 5 or time.monotonic() > deadline_s:
            break
        time.sleep(0.1)
    assert status["connections"]["limit"] == 5
    assert (status["settings"]["max_connections"], status["settings"]["hello_timeout_s"],
            status["settings"]["max_outbox_bytes"], status["settings"]["frame_timeout_s"]) == (5, 2.5, 65536, 30.0)
