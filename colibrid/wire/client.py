"""A blocking client connection to colibrid: the hello handshake, request ids, and the events
that belong to each request (docs/protocol.md is the contract).

Requests carry an ``id`` we choose; the daemon tags every event with the id it answers, so
several requests may be open at once and their events interleave. ``Connection`` keeps events
that arrive for a request nobody is currently reading in a per-id queue, so callers can read
one request at a time without losing the others. colibrictl and the bench scripts use it; the
gateway, on asyncio, has its own (colibrid/gateway/daemon_client.py) over the same frames and events.

msgpack and the standard library only: a client must install and start without anything the
daemon needs (numpy, the C library, the model).
"""

from __future__ import annotations

import collections
import itertools
import os
import socket
import stat
import time
from typing import Any, Iterator

from colibrid.wire.errors import ClientError, DaemonUnreachable, ProtocolViolation, RequestError
from colibrid.wire.frames import (
    LENGTH_PREFIX, MAX_EVENT_FRAME_BYTES, PROTOCOL_VERSION, decode_event_body, encode_frame, event_body_length,
)

DEFAULT_SOCKET_PATH = "/run/colibri/colibrid.sock"
# How long connecting and the hello may take. A daemon that is stuck, or has as many clients
# as it takes and a full backlog, must not leave the client hanging; once greeted, waits are
# the request's own (an ask may queue behind others for minutes), so they have no limit.
DEFAULT_CONNECT_TIMEOUT_S = 10.0

_RECV_CHUNK_BYTES = 64 * 1024

# Events that end a request; everything else (token, subscribed, routing, verify_progress,
# verify_damage) is a step along the way.
_FINAL_EVENTS = frozenset({"done", "ok", "hello", "status", "models", "verified", "unsubscribed"})


class _ReadTimedOut(Exception):
    """A read outlasted the socket's timeout (only the handshake has one); Connection.open says so."""


class FrameReader:
    """Reads whole frames from a stream socket, however the bytes are split across recv()."""

    def __init__(self, sock: socket.socket, socket_path: str):
        self._sock = sock
        self._socket_path = socket_path
        self._buffer = bytearray()
        self.max_frame_bytes = MAX_EVENT_FRAME_BYTES

    def read_frame(self) -> dict:
        length = event_body_length(self._read_exactly(LENGTH_PREFIX.size), self.max_frame_bytes)
        return decode_event_body(self._read_exactly(length))

    def _read_exactly(self, count: int) -> bytes:
        while len(self._buffer) < count:
            try:
                chunk = self._sock.recv(max(_RECV_CHUNK_BYTES, count - len(self._buffer)))
            except TimeoutError:
                raise _ReadTimedOut() from None
            except OSError as error:
                raise DaemonUnreachable(self._socket_path, f"connection lost ({error.strerror})")
            if not chunk:
                raise DaemonUnreachable(self._socket_path, "the daemon closed the connection")
            self._buffer += chunk
        data = bytes(self._buffer[:count])
        del self._buffer[:count]
        return data


# --------------------------------------------------------------------------------------------
# Connection
# --------------------------------------------------------------------------------------------


# How often a connect() refused for a full backlog is tried again, until the timeout.
_CONNECT_RETRY_S = 0.05


def _connect_by(sock: socket.socket, socket_path: str, deadline_s: float | None) -> None:
    """connect(), waiting for room in the daemon's backlog until deadline_s (monotonic).

    A Unix socket with a timeout is non-blocking underneath, and a non-blocking connect() to
    a full backlog fails at once with EAGAIN instead of waiting like a blocking one."""
    while True:
        try:
            sock.connect(socket_path)
            return
        except BlockingIOError:
            if deadline_s is not None and time.monotonic() >= deadline_s:
                raise TimeoutError("the daemon's backlog stayed full") from None
            time.sleep(_CONNECT_RETRY_S)


def _not_a_socket(socket_path: str) -> str | None:
    """What the path is when it is no socket: connect() says only "connection refused" for a
    regular file or a directory, which sends people looking for a daemon that is not the
    problem."""
    try:
        mode = os.stat(socket_path).st_mode
    except OSError:
        return None
    if stat.S_ISDIR(mode):
        return "that is a directory, not a socket (name the socket inside it, e.g. colibrid.sock)"
    if not stat.S_ISSOCK(mode):
        return "that is a regular file, not a socket" if stat.S_ISREG(mode) else "that is not a socket"
    return None


def _describe_connect_failure(error: OSError, socket_path: str, timeout_s: float | None = None) -> str:
    """Say why connect() failed in words that point at the fix."""
    if isinstance(error, TimeoutError):
        return f"not accepted within {timeout_s:g} s (the daemon is stuck, or has all the clients it takes)"
    if isinstance(error, FileNotFoundError):
        return "no such socket (the daemon is not running, or uses another socket)"
    if isinstance(error, ConnectionRefusedError):
        return _not_a_socket(socket_path) or "connection refused (nothing is listening on that socket)"
    if isinstance(error, PermissionError):
        return "permission denied (check the socket's mode and your group membership)"
    return error.strerror or str(error)


class Connection:
    """An open, greeted connection to colibrid. Use ``Connection.open(path)``."""

    def __init__(self, sock: socket.socket, socket_path: str):
        self.socket_path = socket_path
        self._sock = sock
        self._reader = FrameReader(sock, socket_path)
        self._next_id = itertools.count(1)
        # Events read while looking for another request's events, by request id.
        self._pending: dict[Any, collections.deque] = collections.defaultdict(collections.deque)
        self._open_ids: set = set()  # requests sent whose final event has not been read
        self.hello: dict = {}  # the daemon's hello event: server, model, max_frame_bytes
        self.max_request_bytes: int | None = None  # the daemon's limit, from its hello

    @classmethod
    def open(cls, socket_path: str, client_name: str,
             timeout_s: float | None = DEFAULT_CONNECT_TIMEOUT_S) -> "Connection":
        """Connect and say hello, within timeout_s (None: no limit); raises DaemonUnreachable,
        RequestError, ProtocolViolation."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            _connect_by(sock, socket_path, None if timeout_s is None else time.monotonic() + timeout_s)
        except OSError as error:
            sock.close()
            raise DaemonUnreachable(socket_path, _describe_connect_failure(error, socket_path, timeout_s)) from error
        connection = cls(sock, socket_path)
        try:
            connection._greet(client_name, timeout_s)
            sock.settimeout(None)
        except BaseException:  # including Ctrl-C during the handshake: never leak the socket
            connection.close()
            raise
        return connection

    def _greet(self, client_name: str, timeout_s: float | None = None) -> None:
        try:
            self.hello = self.request("hello", protocol=PROTOCOL_VERSION, client=client_name)
        except _ReadTimedOut:
            raise DaemonUnreachable(self.socket_path, f"no answer to hello within {timeout_s:g} s "
                                                      "(the daemon is stuck or overloaded)") from None
        if self.hello.get("protocol") != PROTOCOL_VERSION:
            raise ProtocolViolation(f"the daemon speaks protocol {self.hello.get('protocol')!r}")
        limit = self.hello.get("max_frame_bytes")
        if isinstance(limit, int) and limit > 0:
            self.max_request_bytes = limit

    # ---- sending ------------------------------------------------------------------------

    def send(self, op: str, **fields: Any) -> int:
        """Send one request and return its id; its events are read with ``events(id)``."""
        request_id = next(self._next_id)
        frame = encode_frame({"op": op, "id": request_id, **fields})
        body_bytes = len(frame) - LENGTH_PREFIX.size
        if self.max_request_bytes is not None and body_bytes > self.max_request_bytes:
            # The daemon would answer frame_too_large and close the connection; say it first,
            # in the same words, without losing the connection.
            raise RequestError(
                "frame_too_large",
                f"the {op} request is {body_bytes} bytes encoded; "
                f"the daemon accepts at most {self.max_request_bytes}",
                request_id,
            )
        try:
            self._sock.sendall(frame)
        except OSError as error:
            raise DaemonUnreachable(self.socket_path, f"connection lost ({error.strerror or 'timed out'})")
        self._open_ids.add(request_id)
        return request_id

    def cancel(self, target: int) -> None:
        """Ask the daemon to stop request ``target``, without waiting for the answer.

        Best effort: used while the client is exiting (Ctrl-C, closed stdout), when the
        daemon may already be gone; the connection closing right after is the fallback.
        A request whose final event has been read is not cancelled: the daemon would answer
        unknown_request.
        """
        if target not in self._open_ids:
            return
        try:
            self.send("cancel", target=target)
        except ClientError:
            pass

    # ---- receiving ----------------------------------------------------------------------

    def events(self, request_id: Any) -> Iterator[dict]:
        """Yield the events of one request, up to and including its final event.

        An ``error`` event for this request (or a connection-wide one, id null) raises
        RequestError instead of being yielded.
        """
        while True:
            event = self._next_event_for(request_id)
            if event["event"] == "error" or event["event"] in _FINAL_EVENTS:
                self._open_ids.discard(request_id)
            if event["event"] == "error":
                raise RequestError(
                    str(event.get("code", "unknown")),
                    str(event.get("message", "")),
                    event.get("id"),
                )
            yield event
            if event["event"] in _FINAL_EVENTS:
                return

    def request(self, op: str, **fields: Any) -> dict:
        """Send a request whose reply is one event named like the op (hello, status, models)
        and return that event."""
        request_id = self.send(op, **fields)
        event = next(self.events(request_id))
        if event["event"] != op:
            raise ProtocolViolation(f"expected a {op} event, got {event['event']!r}")
        return event

    def _next_event_for(self, request_id: Any) -> dict:
        queued = self._pending.get(request_id)
        if queued:
            return queued.popleft()
        while True:
            event = self._reader.read_frame()
            if not isinstance(event.get("event"), str):
                raise ProtocolViolation(
                    f"the daemon sent a map without an event name: {event!r:.200}")
            owner = event.get("id")
            if not isinstance(owner, (str, int, type(None))):
                raise ProtocolViolation(f"the daemon sent an event with id {owner!r:.200}")
            # An error without an id is about the whole connection: it ends every request.
            if owner == request_id or (owner is None and event["event"] == "error"):
                return event
            self._pending[owner].append(event)

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
