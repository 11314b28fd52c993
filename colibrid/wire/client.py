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
from typing import Any, Iterator, TypeVar

from colibrid.wire.errors import ClientError, DaemonUnreachable, ProtocolViolation, RequestError
from colibrid.wire.events import ErrorEvent, Event, HelloEvent, ModelsEvent, StatusEvent, event_from_wire
from colibrid.wire.frames import (
    LENGTH_PREFIX, MAX_EVENT_FRAME_BYTES, PROTOCOL_VERSION, decode_event_body, encode_frame, event_body_length,
)
from colibrid.wire.requests import AskFields, Cancel, Hello, Models, Status, Subscribe, Verify

DEFAULT_SOCKET_PATH = "/run/colibri/colibrid.sock"
# How long connecting and the hello may take. A daemon that is stuck, or has as many clients
# as it takes and a full backlog, must not leave the client hanging; once greeted, waits are
# the request's own (an ask may queue behind others for minutes), so they have no limit.
DEFAULT_CONNECT_TIMEOUT_S = 10.0

_RECV_CHUNK_BYTES = 64 * 1024

_Reply = TypeVar("_Reply", HelloEvent, StatusEvent, ModelsEvent)  # an event that answers a request alone


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
    """An open, greeted connection to colibrid. Use ``Connection.open(path, client_name)``.

    A request is sent by its method (ask, subscribe, verify; status and models wait for their
    one reply), which returns the id the connection gave it; ``events(id)`` reads what the
    daemon answers, as typed events (colibrid/wire/events.py)."""

    def __init__(self, sock: socket.socket, socket_path: str):
        self.socket_path = socket_path
        self._sock = sock
        self._reader = FrameReader(sock, socket_path)
        self._next_id = itertools.count(1)
        # Events read while looking for another request's events, by request id.
        self._pending: dict[Any, collections.deque[Event]] = collections.defaultdict(collections.deque)
        self._open_ids: set = set()  # requests sent whose final event has not been read
        self.hello: HelloEvent | None = None  # the daemon's hello: server, model, max_frame_bytes
        self.max_request_bytes: int | None = None  # the daemon's limit, from its hello

    @classmethod
    def open(cls, socket_path: str, client_name: str,
             timeout_s: float | None = DEFAULT_CONNECT_TIMEOUT_S) -> "Connection":
        """Connect and say hello as ``client_name`` (for the daemon's logs), within timeout_s
        (None: no limit); raises DaemonUnreachable, RequestError, ProtocolViolation."""
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
            self.hello = self._request(Hello(next(self._next_id), PROTOCOL_VERSION, client_name), HelloEvent)
        except _ReadTimedOut:
            raise DaemonUnreachable(self.socket_path, f"no answer to hello within {timeout_s:g} s "
                                                      "(the daemon is stuck or overloaded)") from None
        if self.hello.protocol != PROTOCOL_VERSION:
            raise ProtocolViolation(f"the daemon speaks protocol {self.hello.protocol!r}")
        if self.hello.max_frame_bytes > 0:
            self.max_request_bytes = self.hello.max_frame_bytes

    # ---- requests -----------------------------------------------------------------------

    def ask(self, fields: AskFields) -> int:
        """Send an ask; its events (tokens, then done) are read with ``events(id)``."""
        return self._send(fields.to_wire(next(self._next_id)))

    def subscribe(self, stream: str) -> int:
        """Subscribe to a stream ("routing"): `subscribed`, then its events, until cancelled."""
        return self._send(Subscribe(next(self._next_id), stream).to_wire())

    def verify(self, background: bool = False, max_mb_per_s: float | None = None, stop: bool = False) -> int:
        """Have the daemon check its pack (in the foreground: progress and findings until `verified`)."""
        return self._send(Verify(next(self._next_id), background, max_mb_per_s, stop).to_wire())

    def status(self) -> StatusEvent:
        return self._request(Status(next(self._next_id)), StatusEvent)

    def models(self) -> ModelsEvent:
        return self._request(Models(next(self._next_id)), ModelsEvent)

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
            self._send(Cancel(next(self._next_id), target).to_wire())
        except ClientError:
            pass

    def _request(self, request: Hello | Status | Models, reply: type[_Reply]) -> _Reply:
        """Send a request whose answer is one event (hello, status, models) and return that event."""
        event = next(self.events(self._send(request.to_wire())))
        if not isinstance(event, reply):
            raise ProtocolViolation(f"expected a {reply.name} event, got {event.name!r}")
        return event

    def _send(self, message: dict[str, Any]) -> int:
        """Send one request map; its id."""
        request_id = message["id"]
        frame = encode_frame(message)
        body_bytes = len(frame) - LENGTH_PREFIX.size
        if self.max_request_bytes is not None and body_bytes > self.max_request_bytes:
            # The daemon would answer frame_too_large and close the connection; say it first,
            # in the same words, without losing the connection.
            raise RequestError(
                "frame_too_large",
                f"the {message['op']} request is {body_bytes} bytes encoded; "
                f"the daemon accepts at most {self.max_request_bytes}",
                request_id,
            )
        try:
            self._sock.sendall(frame)
        except OSError as error:
            raise DaemonUnreachable(self.socket_path, f"connection lost ({error.strerror or 'timed out'})")
        self._open_ids.add(request_id)
        return request_id

    # ---- receiving ----------------------------------------------------------------------

    def events(self, request_id: Any) -> Iterator[Event]:
        """Yield the events of one request, up to and including its final event.

        An ``error`` event for this request (or a connection-wide one, id null) raises
        RequestError instead of being yielded.
        """
        while True:
            event = self._next_event_for(request_id)
            if event.final:
                self._open_ids.discard(request_id)
            if isinstance(event, ErrorEvent):
                raise RequestError(event.code, event.message, event.id)
            yield event
            if event.final:
                return

    def _next_event_for(self, request_id: Any) -> Event:
        queued = self._pending.get(request_id)
        if queued:
            return queued.popleft()
        while True:
            event = event_from_wire(self._reader.read_frame())
            # An error without an id is about the whole connection: it ends every request.
            if event.id == request_id or (event.id is None and isinstance(event, ErrorEvent)):
                return event
            self._pending[event.id].append(event)

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
