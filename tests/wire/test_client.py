"""colibrid.wire.client in-process, over a socketpair: the far end is written by hand, byte
by byte where it matters, so framing and event routing are checked without any server."""

from __future__ import annotations

import socket
import struct
import threading

import msgpack
import pytest

from colibrid.wire.client import Connection
from colibrid.wire.errors import DaemonUnreachable, ProtocolViolation, RequestError
from colibrid.wire.events import DoneEvent, StatusEvent, TokenEvent, UnknownEvent
from colibrid.wire.frames import encode_frame
from colibrid.wire.requests import AskFields


def _frame(message) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def _received(far_end: socket.socket) -> list[dict]:
    """Every request the client has sent so far (the far end reads without blocking)."""
    far_end.setblocking(False)
    data = b""
    try:
        while chunk := far_end.recv(65536):
            data += chunk
    except BlockingIOError:
        pass
    requests = []
    while data:
        (length,) = struct.unpack(">I", data[:4])
        requests.append(msgpack.unpackb(data[4:4 + length], raw=False))
        data = data[4 + length:]
    return requests


@pytest.fixture
def pair():
    near, far = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    connection = Connection(near, "/test/colibrid.sock")
    yield connection, far
    connection.close()
    far.close()


def test_a_frame_is_a_big_endian_length_and_one_msgpack_map():
    frame = encode_frame({"op": "status", "id": 3})

    assert frame[:4] == struct.pack(">I", len(frame) - 4)
    assert msgpack.unpackb(frame[4:]) == {"op": "status", "id": 3}


def test_requests_get_distinct_ids(pair):
    connection, far = pair

    ids = [connection.ask(AskFields(prompt="a")), connection.subscribe("routing")]

    assert len(set(ids)) == 2
    assert [request["id"] for request in _received(far)] == ids


def test_frames_split_across_reads_are_reassembled(pair):
    connection, far = pair
    data = _frame({"event": "status", "id": 1, "model": "m"})  # the answer to the first request
    for byte in data:  # one byte per send: the worst a stream socket may do
        far.send(bytes([byte]))

    assert connection.status().fields["model"] == "m"


def test_interleaved_events_reach_their_own_request(pair):
    connection, far = pair
    first, second = connection.ask(AskFields(prompt="a")), connection.ask(AskFields(prompt="b"))
    far.sendall(
        _frame({"event": "token", "id": second, "token_ids": [2], "text": "B"})
        + _frame({"event": "token", "id": first, "token_ids": [1], "text": "A"})
        + _frame({"event": "done", "id": second, "finish_reason": "stop", "text": "B", "usage": {}})
        + _frame({"event": "done", "id": first, "finish_reason": "stop", "text": "A", "usage": {}})
    )

    first_events, second_events = list(connection.events(first)), list(connection.events(second))
    first_texts = [event.text for event in first_events]
    second_texts = [event.text for event in second_events]

    assert [type(event) for event in first_events] == [TokenEvent, DoneEvent]

    assert first_texts == ["A", "A"]  # token, done
    assert second_texts == ["B", "B"]  # read earlier, kept, then delivered in order


def test_an_error_event_raises_request_error(pair):
    connection, far = pair
    request_id = connection.ask(AskFields(prompt="x"))
    far.sendall(_frame({"event": "error", "id": request_id, "code": "engine",
                        "message": "expert checksum mismatch"}))

    with pytest.raises(RequestError) as raised:
        list(connection.events(request_id))

    assert (raised.value.code, raised.value.message) == ("engine", "expert checksum mismatch")


def test_a_connection_wide_error_ends_any_request(pair):
    connection, far = pair
    request_id = connection.subscribe("routing")
    far.sendall(_frame({"event": "error", "id": None, "code": "bad_frame", "message": "no"}))

    with pytest.raises(RequestError, match="bad_frame"):
        list(connection.events(request_id))


@pytest.mark.parametrize(
    "garbage",
    [
        struct.pack(">I", 0),  # zero length
        struct.pack(">I", 3) + b"abc",  # three msgpack values, not one
        _frame([1, 2, 3]),  # msgpack, but not a map
        _frame({"id": 1}),  # a map without an event name
        _frame({"event": "done", "id": 1, "text": "x"}),  # a done without its finish_reason and usage
        _frame({"event": "token", "id": 1, "token_ids": [1], "text": None}),  # a token without its text
    ],
)
def test_bad_frames_from_the_daemon_are_protocol_violations(pair, garbage):
    connection, far = pair
    request_id = connection.ask(AskFields(prompt="x"))
    far.sendall(garbage)

    with pytest.raises(ProtocolViolation):
        list(connection.events(request_id))


def test_the_daemon_closing_mid_frame_is_unreachable(pair):
    connection, far = pair
    request_id = connection.subscribe("routing")
    far.sendall(_frame({"event": "routing", "id": request_id})[:-2])
    far.close()

    with pytest.raises(DaemonUnreachable) as raised:
        list(connection.events(request_id))

    assert raised.value.socket_path == "/test/colibrid.sock"


def test_a_request_over_the_daemons_limit_is_refused_before_sending(pair):
    connection, far = pair
    connection.max_request_bytes = 100

    with pytest.raises(RequestError) as raised:
        connection.ask(AskFields(prompt="x" * 200))

    assert raised.value.code == "frame_too_large"
    assert raised.value.message.startswith("the ask request is ")
    assert _received(far) == []  # the connection stays usable


def test_open_says_hello_first_and_keeps_the_daemons_limit(socket_path):
    # Connection.open over a real listening socket, answered by hand.
    path = socket_path

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        server.listen(1)
        seen = []

        def greet():
            peer, _ = server.accept()
            with peer:
                data = peer.recv(4096)
                seen.append(msgpack.unpackb(data[4:]))
                peer.sendall(_frame({"event": "hello", "id": seen[0]["id"], "protocol": 1,
                                     "server": "colibrid 0.1.0", "model": "m",
                                     "max_frame_bytes": 4096}))
                peer.recv(1)  # wait for the client to close

        thread = threading.Thread(target=greet, daemon=True)
        thread.start()
        with Connection.open(path, "tests") as connection:
            assert connection.hello.model == "m"
            assert connection.max_request_bytes == 4096
        thread.join(timeout=5)

    assert seen[0]["op"] == "hello" and seen[0]["protocol"] == 1


def test_open_on_a_missing_socket_names_it(tmp_path):
    missing = str(tmp_path / "absent.sock")

    with pytest.raises(DaemonUnreachable) as raised:
        Connection.open(missing, "tests")

    assert raised.value.socket_path == missing
    assert missing in str(raised.value)


def test_a_reply_of_the_wrong_kind_is_a_protocol_violation(pair):
    connection, far = pair
    far.sendall(_frame({"event": "models", "id": 1, "models": []}))

    with pytest.raises(ProtocolViolation, match="expected a status event"):
        connection.status()


def test_cancel_is_sent_only_for_a_request_still_open(pair):
    connection, far = pair
    finished, running = connection.ask(AskFields(prompt="a")), connection.ask(AskFields(prompt="b"))
    far.sendall(_frame({"event": "done", "id": finished, "finish_reason": "stop", "text": "", "usage": {}}))
    list(connection.events(finished))
    _received(far)  # drain the two asks

    connection.cancel(finished)
    connection.cancel(running)

    assert [(r["op"], r["target"]) for r in _received(far)] == [("cancel", running)]


def test_an_event_a_newer_daemon_invented_is_a_step_of_its_request(pair):
    connection, far = pair
    request_id = connection.subscribe("routing")
    far.sendall(_frame({"event": "routing_hint", "id": request_id, "what": "x"})
                + _frame({"event": "unsubscribed", "id": request_id, "reason": "cancelled"}))

    hint, end = list(connection.events(request_id))

    assert hint == UnknownEvent(request_id, "routing_hint", {"what": "x"}) and end.reason == "cancelled"


def test_status_is_read_as_an_open_map(pair):
    connection, far = pair
    far.sendall(_frame({"event": "status", "id": 1, "model": "m", "cache": {"hits": 1}}))

    status = connection.status()

    assert status == StatusEvent(1, {"model": "m", "cache": {"hits": 1}})
    assert _received(far) == [{"op": "status", "id": 1}]
