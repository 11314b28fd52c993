"""A client that breaks the protocol gets one error and loses its connection; nobody else notices."""

from __future__ import annotations

import socket
import struct

import msgpack
import pytest

from tests.daemon.wire import WireClient


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def assert_daemon_still_answers(daemon) -> None:
    with WireClient(daemon.socket_path) as client:
        client.hello()
        client.ask("check", max_tokens=2)
        _, done = client.collect("check")
    assert done["event"] == "done"


def expect_error_then_close(client: WireClient, code: str, request_id=None) -> dict:
    error = client.recv()
    assert error["event"] == "error" and error["code"] == code, error
    assert error["id"] == request_id
    assert isinstance(error["message"], str) and error["message"]
    assert client.is_closed_by_server()
    return error


@pytest.mark.parametrize("raw_bytes, code", [
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "frame_too_large"),  # "GET " read as a length: ~1.2 GB
    (frame(b"\xc1\xc1\xc1 not msgpack"), "bad_frame"),
    (frame(msgpack.packb([1, 2, 3])), "bad_frame"),  # msgpack, but not a map
    (frame(msgpack.packb({1: "int key"})), "bad_frame"),
    (frame(msgpack.packb({"op": "hello"}) + b"\x00"), "bad_frame"),  # two objects in one frame
    (struct.pack(">I", 0), "bad_frame"),
], ids=["http", "garbage", "array", "int-keys", "trailing-bytes", "zero-length"])
def test_bytes_that_are_not_a_frame(shared_daemon, raw_bytes, code):
    with WireClient(shared_daemon.socket_path) as client:
        client.send_raw(raw_bytes)
        expect_error_then_close(client, code)
    assert_daemon_still_answers(shared_daemon)


def test_a_one_gib_length_prefix_is_refused_before_reading_the_body(shared_daemon):
    with WireClient(shared_daemon.socket_path) as client:
        client.hello()
        client.send_raw(struct.pack(">I", 1 << 30) + b"x" * 100)
        error = expect_error_then_close(client, "frame_too_large")
        assert "1073741824" in error["message"]
    with WireClient(shared_daemon.socket_path) as client:
        client.hello()
        client.send({"op": "status", "id": "s"})
        assert client.recv()["memory"]["rss_bytes"] < 1 << 30  # it never allocated the body


def test_a_frame_truncated_by_close_is_answered_bad_frame(shared_daemon):
    with WireClient(shared_daemon.socket_path) as client:
        client.hello()
        client.send_raw(struct.pack(">I", 100) + b"\x81\xa2op")
        client.sock.shutdown(socket.SHUT_WR)  # "closed mid-frame"; our read side still hears the error
        expect_error_then_close(client, "bad_frame")
    assert_daemon_still_answers(shared_daemon)


def test_a_request_before_hello(shared_daemon):
    with WireClient(shared_daemon.socket_path) as client:
        client.send({"op": "status", "id": 1})
        expect_error_then_close(client, "bad_request", request_id=1)
    assert_daemon_still_answers(shared_daemon)


def test_an_unsupported_protocol_version(shared_daemon):
    with WireClient(shared_daemon.socket_path) as client:
        client.send({"op": "hello", "id": "h", "protocol": 2})
        expect_error_then_close(client, "unsupported_protocol", request_id="h")


def test_an_unknown_op(shared_daemon):
    with WireClient(shared_daemon.socket_path) as client:
        client.hello()
        client.send({"op": "generate", "id": 3})
        expect_error_then_close(client, "unknown_op", request_id=3)
    assert_daemon_still_answers(shared_daemon)


@pytest.mark.parametrize("request_fields, request_id", [
    ({"op": "ask", "id": 1, "prompt": "x", "max_tokens": "5"}, 1),
    ({"op": "ask", "id": 1, "prompt": "x", "temperature": True}, 1),
    ({"op": "ask", "id": 1, "prompt": 42}, 1),
    ({"op": "ask", "id": 1, "prompt": "x", "stop": "\n"}, 1),
    ({"op": "ask", "id": 1, "messages": [{"role": "user"}]}, 1),
    ({"op": "ask", "id": 1}, 1),  # neither prompt nor messages
    ({"op": "ask", "id": 1, "prompt": "x", "messages": []}, 1),  # both
    ({"op": "ask", "id": 1.5, "prompt": "x"}, None),  # an id must be a string or an integer
    ({"op": "ask", "prompt": "x"}, None),
    ({"op": 7, "id": "n"}, "n"),
    ({"op": "cancel", "id": "c"}, "c"),
], ids=["max_tokens-str", "temperature-bool", "prompt-int", "stop-str", "message-no-content", "no-prompt",
        "prompt-and-messages", "float-id", "no-id", "op-int", "cancel-no-target"])
def test_wrong_field_types(shared_daemon, request_fields, request_id):
    with WireClient(shared_daemon.socket_path) as client:
        client.hello()
        client.send(request_fields)
        expect_error_then_close(client, "bad_request", request_id=request_id)
    assert_daemon_still_answers(shared_daemon)


def test_a_broken_client_does_not_disturb_a_stream_in_progress(shared_daemon):
    with WireClient(shared_daemon.socket_path) as steady:
        steady.hello()
        steady.ask("steady", max_tokens=30)
        with WireClient(shared_daemon.socket_path) as vandal:
            vandal.send_raw(b"\xff" * 64)
            expect_error_then_close(vandal, "frame_too_large")
        tokens, done = steady.collect("steady")
    assert done["event"] == "done" and len(tokens) == done["usage"]["generated_tokens"]
