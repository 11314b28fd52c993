"""One client's connection: its requests in, its replies out (docs/protocol.md).

Each connection has a reader (frames in -> requests) and a writer (an outbox of encoded frames
-> the socket). Replies never write to the socket directly: they go into the outbox, so a
client that reads slowly never blocks the engine thread or another client. What one client
can cost is bounded (ClientLimits, each a config key):

  - its outbox: above max_outbox_bytes the reader stops taking its requests until the outbox
    drains; if it stays above for stalled_client_timeout_s the client is closed (`slow_client`)
    and its asks end as if it had disconnected, so the engine moves on;
  - its time: the reader yields to the event loop after every request, so a pipeline of
    thousands cannot keep the loop from other clients; a hello must arrive within
    hello_timeout_s, and a frame that has begun within frame_timeout_s (`timeout`).

A connection that breaks the protocol gets one `error` and is closed; nothing it sends can
reach the other connections.

Its peer credentials (SO_PEERCRED), read when it is accepted, are named in every log line
about it and checked against allow_users / allow_groups; a refused peer's first request is
answered with `forbidden` and the connection is closed.

The server (colibrid/daemon/server.py) accepts connections and serves each with a Connection;
what a connection needs of it is the Host below.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from colibrid.daemon.access import AccessPolicy, PeerCredentials, may_administer, peer_credentials
from colibrid.daemon.engine_loop import (
    STOP_CANCELLED, STOP_DISCONNECTED, EngineLoop, IntakeClosed, Job, QueueFull, cancelled_done, shutdown_error,
)
from colibrid.daemon.routing_stream import Subscription, TooManySubscribers
from colibrid.daemon.verify_request import DEFAULT_BACKGROUND_MB_PER_S, PackVerification, VerifyBusy, VerifyRun
from colibrid.wire.errors import ProtocolError, RequestId
from colibrid.wire.events import (
    DoneEvent, ErrorEvent, Event, HelloEvent, ModelsEvent, OkEvent, StatusEvent, SubscribedEvent, UnsubscribedEvent,
    VerifiedEvent, VerifyDamageEvent, VerifyProgressEvent,
)
from colibrid.wire.frames import LENGTH_PREFIX, decode_request_body, encode_frame, request_body_length
from colibrid.wire.requests import (
    Ask, Cancel, Hello, Models, Request, Status, Subscribe, Verify, parse_request, usable_id,
)

log = logging.getLogger(__name__)

# How long a closing connection may take to hand its last frames to the kernel; a client that
# stopped reading must not hold the daemon's shutdown (or its own slot) forever.
FLUSH_TIMEOUT_S = 5.0
# Findings a `verified` event lists (each was sent as a verify_damage event as it was found).
MAX_DAMAGE_IN_VERIFIED = 1000


@dataclass(frozen=True)
class ClientLimits:
    """What one client may cost the daemon; the config keys of the same names (all reloadable)."""

    max_connections: int = 128
    max_outbox_bytes: int = 1024 * 1024
    stalled_client_timeout_s: float = 30.0
    hello_timeout_s: float = 10.0
    frame_timeout_s: float = 30.0

    @classmethod
    def from_config(cls, config) -> "ClientLimits":
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class ServerSettings:
    """What the server reads of the daemon's config, all of it reloadable (Server.reconfigure):
    the frame limit, the default max_tokens, who may connect, what one client may cost."""

    max_frame_bytes: int = 1024 * 1024
    default_max_tokens: int = 256
    access: AccessPolicy = field(default_factory=AccessPolicy)
    limits: ClientLimits = field(default_factory=ClientLimits)

    @classmethod
    def from_config(cls, config) -> "ServerSettings":
        return cls(config.max_frame_bytes, config.default_max_tokens,
                   AccessPolicy(config.allow_users, config.allow_groups), ClientLimits.from_config(config))


class Host(Protocol):
    """What a connection uses of the server that accepted it: settings read afresh at each use
    (a reload replaces them), the daemon's shared parts, and the replies that need its whole view."""

    settings: ServerSettings
    model: dict[str, Any]  # the `models` entry of the model served
    engine_loop: EngineLoop
    verification: PackVerification

    def hello_event(self, request_id: RequestId) -> HelloEvent: ...

    def status_event(self, request_id: RequestId) -> StatusEvent: ...

    def subscribed_event(self, request_id: RequestId, stream: str) -> SubscribedEvent: ...


class ClientTooSlow(Exception):
    """The client left more than max_outbox_bytes unread for stalled_client_timeout_s."""


def _drop_event(event: Event) -> None:
    """A Job's emit until its connection provides the real one."""


def _ignore(*_: Any) -> None:
    """What a background verify reports as it goes: nobody listens (status shows it)."""


class Connection:
    """One client: its open asks, its outbox, and the tasks that read and write its socket."""

    def __init__(self, server: Host, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 number: int) -> None:
        self.server = server
        self.number = number  # for the log only
        self.peer: PeerCredentials | None = peer_credentials(writer.get_extra_info("socket"))
        self.name = f"connection {number} ({self.peer.describe() if self.peer else 'peer unknown'})"
        # Prefix reuse stays within one user: what another asked is neither reused nor revealed
        # (by cached_prompt_tokens or a fast first token). A peer of unknown uid shares with nobody.
        self.prefix_scope = f"uid {self.peer.uid}".encode() if self.peer else f"connection {number}".encode()
        self._reader = reader
        self._writer = writer
        self._loop = asyncio.get_running_loop()
        # Encoded frames not yet handed to the socket, and their total size. The reader waits
        # for room (below max_outbox_bytes) before it takes the next request.
        self._outbox: collections.deque[bytes] = collections.deque()
        self._outbox_bytes = 0
        self._outbox_over_limit_since_s: float | None = None  # monotonic; None while within the limit
        self._outbox_has_room = asyncio.Event()
        self._outbox_has_room.set()
        self._frame_queued = asyncio.Event()  # wakes the writer: a frame, or _closed set
        self._open_asks: dict[RequestId, Job] = {}
        self._verify: tuple[RequestId, VerifyRun] | None = None  # its foreground verify, while it runs
        self._subscriptions: dict[RequestId, Subscription] = {}  # its open `subscribe` requests
        self._greeted = False
        self._closed = False  # no more frames are queued once set
        self._serve_task: asyncio.Task | None = None
        self._read_task: asyncio.Task | None = None
        self._write_task: asyncio.Task | None = None

    async def serve(self) -> None:
        log.debug("%s opened", self.name)
        self._serve_task = asyncio.current_task()
        self._write_task = asyncio.create_task(self._write_frames())
        self._read_task = asyncio.create_task(self._read_requests())
        try:
            await self._read_task
        except asyncio.CancelledError:
            pass  # stop() cancelled the reader: the daemon is shutting down
        except (ConnectionError, OSError) as exc:
            log.debug("%s: read failed: %s", self.name, exc)
        finally:
            await self._finish()

    async def close(self) -> None:
        """For shutdown: stop reading; serve() then flushes what is queued and closes."""
        if self._read_task is not None:
            self._read_task.cancel()
        if self._serve_task is not None:
            await asyncio.wait([self._serve_task], timeout=2 * FLUSH_TIMEOUT_S + 1)

    async def _finish(self) -> None:
        for job in self._open_asks.values():
            self.server.engine_loop.withdraw(job, STOP_DISCONNECTED)
        self._open_asks.clear()
        if self._verify is not None:  # nobody is watching it any more
            self.server.verification.stop(self._verify[1])
        self.end_subscriptions(None)
        self._closed = True
        self._frame_queued.set()  # the writer sends what is queued, then returns
        try:
            await asyncio.wait_for(self._write_task, FLUSH_TIMEOUT_S)
            self._writer.close()  # unlike abort(), sends what is still buffered first
            await asyncio.wait_for(self._writer.wait_closed(), FLUSH_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.debug("%s: client stopped reading; dropping its unsent frames", self.name)
        except (ConnectionError, OSError):
            pass  # the client is gone already
        self._writer.transport.abort()
        log.debug("%s closed", self.name)

    # -- reading ---------------------------------------------------------------------------

    async def _read_requests(self) -> None:
        hello_deadline_s = self._loop.time() + self.server.settings.limits.hello_timeout_s
        while True:
            # A client that does not read its replies gets no more of them made for it.
            await self._outbox_has_room.wait()
            try:
                message = await self._read_frame(None if self._greeted else hello_deadline_s)
                if message is None:
                    return  # the client closed the connection between frames
                self._handle(message)
            except ProtocolError as exc:
                log.debug("%s: %s: %s", self.name, exc.code, exc.message)
                self.send(ErrorEvent(exc.request_id, exc.code, exc.message))
                if exc.closes_connection:
                    return
            # Requests that are already buffered are read without waiting, so a pipeline of
            # thousands would hold the loop: let other connections (and accept) go between two.
            await asyncio.sleep(0)

    async def _read_frame(self, hello_deadline_s: float | None) -> dict[str, Any] | None:
        """The next frame's map; None if the client closed between frames. Before hello the whole
        frame must arrive by hello_deadline_s; after, a frame may take frame_timeout_s once begun."""
        try:
            first_byte = await self._read_by(1, hello_deadline_s, "hello")
        except asyncio.IncompleteReadError:
            return None
        frame_deadline_s = self._loop.time() + self.server.settings.limits.frame_timeout_s
        deadline_s, waited_for = frame_deadline_s, "frame"
        if hello_deadline_s is not None and hello_deadline_s < frame_deadline_s:
            deadline_s, waited_for = hello_deadline_s, "hello"
        try:
            prefix = first_byte + await self._read_by(LENGTH_PREFIX.size - 1, deadline_s, waited_for)
        except asyncio.IncompleteReadError:
            raise ProtocolError("bad_frame", "connection closed in the middle of a length prefix") from None
        length = request_body_length(prefix, self.server.settings.max_frame_bytes)  # checked before reading: never allocate it
        try:
            body = await self._read_by(length, deadline_s, waited_for)
        except asyncio.IncompleteReadError as exc:
            raise ProtocolError("bad_frame", f"connection closed after {len(exc.partial)} of {length} bytes "
                                             "of a frame") from None
        return decode_request_body(body)

    async def _read_by(self, count: int, deadline_s: float | None, waited_for: str) -> bytes:
        """readexactly(count), or a `timeout` error if the bytes have not all come by deadline_s."""
        if deadline_s is None:
            return await self._reader.readexactly(count)
        try:
            return await asyncio.wait_for(self._reader.readexactly(count), max(0.0, deadline_s - self._loop.time()))
        except asyncio.TimeoutError:
            limits = self.server.settings.limits
            if waited_for == "hello":
                message = f"no hello within hello_timeout_s ({limits.hello_timeout_s:g} s) of connecting"
            else:
                message = f"a frame began but did not end within frame_timeout_s ({limits.frame_timeout_s:g} s)"
            raise ProtocolError("timeout", message) from None

    def _handle(self, message: dict[str, Any]) -> None:
        if not self.server.settings.access.allows(self.peer):
            log.warning("%s refused: not in allow_users or allow_groups", self.name)
            raise ProtocolError("forbidden", "this user may not use colibrid (allow_users / allow_groups in its "
                                "config)", usable_id(message))
        request = parse_request(message, self.server.settings.default_max_tokens, self.server.model["sampling_defaults"],
                                greeted=self._greeted)
        if (request.id in self._open_asks or request.id in self._subscriptions
                or (self._verify is not None and request.id == self._verify[0])):
            raise ProtocolError("bad_request", f"id {request.id!r} is already open on this connection", request.id)
        self._dispatch(request)

    def _dispatch(self, request: Request) -> None:
        if isinstance(request, Hello):
            self._greeted = True
            log.debug("%s: hello from %s", self.name, request.client or "an unnamed client")
            self.send(self.server.hello_event(request.id))
        elif isinstance(request, Ask):
            self._submit(request)
        elif isinstance(request, Cancel):
            self._cancel(request)
        elif isinstance(request, Subscribe):
            self._subscribe(request)
        elif isinstance(request, Status):
            self.send(self.server.status_event(request.id))
        elif isinstance(request, Models):
            self.send(ModelsEvent(request.id, [self.server.model]))
        elif isinstance(request, Verify):
            self._start_verify(request)

    def _start_verify(self, request: Verify) -> None:
        """A foreground verify streams its progress and findings to this connection until
        `verified`; a background one (or a stop) is answered with `ok` at once."""
        if not may_administer(self.peer):
            log.warning("%s: verify refused: only root and colibrid's own user may verify", self.name)
            self.send(ErrorEvent(request.id, "not_permitted", "verify is for root and colibrid's own user (it reads "
                                                               "the whole pack); run colibrictl with sudo"))
            return
        verification = self.server.verification
        if request.stop:
            stopped = verification.stop()
            log.info("%s: verify stop%s", self.name, "ped" if stopped else ": none was running")
            self.send(OkEvent(request.id))
            return
        rid, send = request.id, self._send_threadsafe
        cap = request.max_mb_per_s or (DEFAULT_BACKGROUND_MB_PER_S if request.background else None)
        if request.background:
            run = VerifyRun(self.name, True, cap, on_progress=_ignore, on_damage=_ignore, on_done=_ignore)
        else:
            run = VerifyRun(self.name, False, cap,
                            on_progress=lambda progress: send(VerifyProgressEvent(rid, **progress)),
                            on_damage=lambda damage: send(VerifyDamageEvent(rid, **damage.to_json())),
                            on_done=lambda report: self._call_threadsafe(
                                self._verify_done, rid, VerifiedEvent(rid, **report.to_json(MAX_DAMAGE_IN_VERIFIED))))
        try:
            verification.start(run)
        except VerifyBusy as exc:
            self.send(ErrorEvent(rid, "busy", str(exc)))
            return
        if request.background:
            self.send(OkEvent(rid))
        else:
            self._verify = (rid, run)

    def _verify_done(self, request_id: RequestId, event: Event) -> None:
        if self._verify is not None and self._verify[0] == request_id:
            self._verify = None
        self.send(event)

    def _call_threadsafe(self, callback, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop is closed: the daemon is gone, and so is the client
            pass

    def _send_threadsafe(self, event: Event) -> None:
        self._call_threadsafe(self.send, event)

    def _submit(self, ask: Ask) -> None:
        log.debug("%s: ask %r, max_tokens %d", self.name, ask.id, ask.params.max_tokens)
        job = Job(ask, emit=_drop_event, origin=self.name, prefix_scope=self.prefix_scope)
        job.emit = self._emitter(job)
        self._open_asks[ask.id] = job
        try:
            self.server.engine_loop.submit(job)
        except QueueFull:
            self._deliver(job, ErrorEvent(ask.id, "busy", f"the queue is full ({self.server.engine_loop.max_queue} "
                                                           "requests waiting); try again later"))
        except IntakeClosed:
            self._deliver(job, shutdown_error(job))

    def _subscribe(self, request: Subscribe) -> None:
        """A routing subscription: `subscribed` (the model's routing shape), then a `routing`
        event per step until the client cancels it or goes away."""
        stream = self.server.engine_loop.routing
        try:
            subscription = stream.subscribe(request.id, self.send, lambda: self._outbox_bytes,
                                            self.server.settings.limits.max_outbox_bytes)
        except TooManySubscribers as exc:
            self.send(ErrorEvent(request.id, "busy", f"{exc}; try again later"))
            return
        self._subscriptions[request.id] = subscription
        log.debug("%s: subscribed to %s (%d subscribers)", self.name, request.stream, stream.subscribers)
        self.send(self.server.subscribed_event(request.id, request.stream))

    def end_subscriptions(self, reason: str | None) -> None:
        """Ends every subscription of this connection, telling the client why (None: it is gone)."""
        for request_id, subscription in list(self._subscriptions.items()):
            self.server.engine_loop.routing.unsubscribe(subscription)
            if reason is not None:
                self.send(UnsubscribedEvent(request_id, reason))
        self._subscriptions.clear()

    def _cancel(self, cancel: Cancel) -> None:
        if self._verify is not None and self._verify[0] == cancel.target:
            self.send(OkEvent(cancel.id))
            self.server.verification.stop(self._verify[1])  # it ends with `verified`, cancelled
            return
        subscription = self._subscriptions.pop(cancel.target, None)
        if subscription is not None:
            self.server.engine_loop.routing.unsubscribe(subscription)
            self.send(OkEvent(cancel.id))
            self.send(UnsubscribedEvent(cancel.target, "cancelled"))
            return
        job = self._open_asks.get(cancel.target)
        if job is None:
            raise ProtocolError("unknown_request", f"no open ask or subscription with id {cancel.target!r} on this "
                                "connection", cancel.id)
        self.send(OkEvent(cancel.id))
        if self.server.engine_loop.withdraw(job, STOP_CANCELLED):
            self._deliver(job, cancelled_done(job))  # it never started; otherwise the worker ends it

    # -- writing ---------------------------------------------------------------------------

    def _emitter(self, job: Job):
        """A thread-safe emit for `job`: the engine thread hands events to this loop and never waits."""
        loop = self._loop

        def emit(event: Event) -> None:
            try:
                loop.call_soon_threadsafe(self._deliver, job, event)
            except RuntimeError:  # the loop is closed: the daemon is gone, and so is the client
                pass

        return emit

    def _deliver(self, job: Job, event: Event) -> None:
        if isinstance(event, (DoneEvent, ErrorEvent)) and self._open_asks.get(job.ask.id) is job:
            del self._open_asks[job.ask.id]
        self.send(event)

    def send(self, event: Event) -> None:
        if self._closed:
            return
        frame = encode_frame(event.to_wire())
        self._outbox.append(frame)
        self._outbox_bytes += len(frame)
        self._frame_queued.set()
        if self._outbox_bytes > self.server.settings.limits.max_outbox_bytes and self._outbox_over_limit_since_s is None:
            self._outbox_over_limit_since_s = time.monotonic()
            self._outbox_has_room.clear()

    def _take_frame(self) -> bytes:
        frame = self._outbox.popleft()
        self._outbox_bytes -= len(frame)
        if self._outbox_bytes <= self.server.settings.limits.max_outbox_bytes:
            self._outbox_over_limit_since_s = None
            self._outbox_has_room.set()
        return frame

    def _seconds_until_too_slow(self) -> float:
        """How long the outbox may stay over its limit from now on (the timeout while within it)."""
        timeout_s = self.server.settings.limits.stalled_client_timeout_s
        if self._outbox_over_limit_since_s is None:
            return timeout_s
        return max(0.0, self._outbox_over_limit_since_s + timeout_s - time.monotonic())

    async def _write_frames(self) -> None:
        try:
            while True:
                if not self._outbox:
                    if self._closed:
                        return
                    self._frame_queued.clear()
                    await self._frame_queued.wait()
                    continue
                self._writer.write(self._take_frame())
                await self._drain()
        except ClientTooSlow:
            self._close_too_slow()
        except (ConnectionError, OSError) as exc:
            log.debug("%s: write failed: %s", self.name, exc)
            self._closed = True
            if self._read_task is not None:
                self._read_task.cancel()  # the client is gone: stop waiting for its requests

    async def _drain(self) -> None:
        """Wait until the socket takes more; ClientTooSlow once the outbox has been over
        max_outbox_bytes for stalled_client_timeout_s."""
        while True:
            try:
                await asyncio.wait_for(self._writer.drain(), self._seconds_until_too_slow())
                return
            except asyncio.TimeoutError:
                if self._outbox_over_limit_since_s is not None and self._seconds_until_too_slow() == 0.0:
                    raise ClientTooSlow() from None

    def _close_too_slow(self) -> None:
        """Drop what it did not read, tell it why (after what the kernel already holds for it), stop
        reading; serve() then ends its asks as for a disconnect, which frees the engine."""
        limits = self.server.settings.limits
        log.warning("%s: closed: more than %d bytes of replies stayed unread for %g s "
                    "(max_outbox_bytes, stalled_client_timeout_s)", self.name, limits.max_outbox_bytes,
                    limits.stalled_client_timeout_s)
        self._outbox.clear()
        self._outbox_bytes = 0
        self._closed = True
        self._writer.write(encode_frame(ErrorEvent(
            None, "slow_client", f"more than {limits.max_outbox_bytes} bytes of replies stayed unread for "
                                 f"{limits.stalled_client_timeout_s:g} s; the connection is closed").to_wire()))
        if self._read_task is not None:
            self._read_task.cancel()
