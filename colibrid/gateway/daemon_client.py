"""The gateway's side of the colibrid protocol (docs/protocol.md), on asyncio.

One DaemonConnection per HTTP request: the request's `ask` is the only one open on it, so its
events arrive in order and nothing has to be told apart by id, and closing the connection is
the daemon's signal that nobody listens any more (on top of the `cancel` we send first). Frames
and events are colibrid.wire's, as for colibrictl: the gateway imports nothing of the engine.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any, AsyncIterator, TypeVar

from colibrid import __version__
from colibrid.wire.errors import ProtocolViolation
from colibrid.wire.events import (
    DoneEvent, ErrorEvent, Event, HelloEvent, ModelsEvent, StatusEvent, TokenEvent, event_from_wire,
)
from colibrid.wire.frames import LENGTH_PREFIX, PROTOCOL_VERSION, decode_event_body, encode_frame, event_body_length
from colibrid.wire.requests import AskFields, Cancel, Hello, Models, Status

log = logging.getLogger(__name__)

CLIENT_NAME = f"colibri-openai {__version__}"

_Reply = TypeVar("_Reply", HelloEvent, StatusEvent, ModelsEvent)  # an event that answers a request alone


class DaemonUnavailable(Exception):
    """colibrid cannot be reached, or went away mid-request; str() says why."""


class DaemonError(Exception):
    """colibrid answered with an `error` event; `code` is the protocol's error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message


class DaemonConnection:
    """An open, greeted connection to colibrid. Use ``await DaemonConnection.open(path)``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, socket_path: str) -> None:
        self._reader = reader
        self._writer = writer
        self.socket_path = socket_path
        self._ids = itertools.count(1)
        self.hello: HelloEvent | None = None
        self.open_ask: int | None = None  # the id of the ask whose `done` has not arrived

    @classmethod
    async def open(cls, socket_path: str, timeout_s: float) -> "DaemonConnection":
        """Connect and say hello within timeout_s; DaemonUnavailable if that fails."""
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(socket_path), timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            raise DaemonUnavailable(f"cannot connect to colibrid at {socket_path}: "
                                    f"{getattr(exc, 'strerror', None) or type(exc).__name__}") from None
        connection = cls(reader, writer, socket_path)
        try:
            connection.hello = await asyncio.wait_for(
                connection._request(Hello(next(connection._ids), PROTOCOL_VERSION, CLIENT_NAME), HelloEvent), timeout_s)
        except asyncio.TimeoutError:
            connection.close()
            raise DaemonUnavailable(f"colibrid at {socket_path} did not answer hello within {timeout_s:g} s") from None
        except BaseException:
            connection.close()
            raise
        return connection

    # ---- requests ---------------------------------------------------------------------------

    async def status(self) -> StatusEvent:
        return await self._request(Status(next(self._ids)), StatusEvent)

    async def models(self) -> ModelsEvent:
        return await self._request(Models(next(self._ids)), ModelsEvent)

    async def ask(self, fields: AskFields) -> AsyncIterator[TokenEvent | DoneEvent]:
        """Send an ask and yield its `token` events, then its `done`; DaemonError for an `error`."""
        request_id = self._send(fields.to_wire(next(self._ids)))
        self.open_ask = request_id
        while True:
            event = await self.next_event(request_id)
            if isinstance(event, DoneEvent):
                self.open_ask = None
                yield event
                return
            if isinstance(event, TokenEvent):
                yield event
            # else: an event an ask does not have (a newer daemon's): nothing here reads it

    def cancel_open_ask(self) -> None:
        """Best effort, without waiting: the HTTP client went away. Closing follows; either stops it."""
        if self.open_ask is not None:
            try:
                self._send(Cancel(next(self._ids), self.open_ask).to_wire())
            except (OSError, RuntimeError):
                pass
            self.open_ask = None

    async def _request(self, request: Hello | Status | Models, reply: type[_Reply]) -> _Reply:
        """A request answered by one event (hello, status, models); that event."""
        event = await self.next_event(self._send(request.to_wire()))
        if not isinstance(event, reply):
            raise ProtocolViolation(f"expected a {reply.name} event from colibrid, got {event.name!r}")
        return event

    def _send(self, message: dict[str, Any]) -> int:
        """Send one request map; its id."""
        self._writer.write(encode_frame(message))
        return message["id"]

    async def next_event(self, request_id: int) -> Event:
        """The next event of `request_id`; an `error` for it (or for the connection) raises DaemonError."""
        while True:
            event = await self._read_event()
            if isinstance(event, ErrorEvent) and event.id in (request_id, None):
                if event.id == self.open_ask:
                    self.open_ask = None
                raise DaemonError(event.code, event.message)
            if event.id == request_id:
                return event
            # The `ok` of a cancel, or a stray event: nothing of ours waits for it.

    async def _read_event(self) -> Event:
        try:
            await self._writer.drain()
            length = event_body_length(await self._reader.readexactly(LENGTH_PREFIX.size))
            message = decode_event_body(await self._reader.readexactly(length))
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            raise DaemonUnavailable(f"the connection to colibrid at {self.socket_path} was lost "
                                    f"({type(exc).__name__})") from None
        return event_from_wire(message)

    def close(self) -> None:
        self._writer.close()


async def one_request(socket_path: str, op: str, timeout_s: float) -> StatusEvent | ModelsEvent:
    """Connect, send one `status` or `models`, return its event, close; all within timeout_s."""
    connection = await DaemonConnection.open(socket_path, timeout_s)
    try:
        return await asyncio.wait_for(connection.status() if op == "status" else connection.models(), timeout_s)
    except asyncio.TimeoutError:
        raise DaemonUnavailable(f"colibrid at {socket_path} did not answer {op} within {timeout_s:g} s") from None
    finally:
        connection.close()
