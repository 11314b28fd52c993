"""The server: accepts connections on the Unix socket and speaks docs/protocol.md on each.

Each connection has a reader (frames in -> requests) and a writer (an outbox of encoded frames
-> the socket). Replies never write to the socket directly: they go into the outbox, so a
client that reads slowly never blocks the engine thread or another client. What one client
can cost is bounded (ClientLimits, each a config key):

  - its outbox: above max_outbox_bytes the reader stops taking its requests until the outbox
    drains; if it stays above for stalled_client_timeout_s the client is closed (`slow_client`)
    and its asks end as if it had disconnected, so the engine moves on;
  - its time: the reader yields to the event loop after every request, so a pipeline of
    thousands cannot keep the loop from other clients; a hello must arrive within
    hello_timeout_s, and a frame that has begun within frame_timeout_s (`timeout`);
  - the number of clients: past max_connections a new one gets `busy` and is closed, well
    before the daemon runs out of file descriptors (which is logged once per interval).

A connection that breaks the protocol gets one `error` and is closed; nothing it sends can
reach the other connections.

Each connection's peer credentials (SO_PEERCRED) are read when it is accepted, named in every
log line about it, and checked against allow_users / allow_groups; a refused peer's first
request is answered with `forbidden` and the connection is closed.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import errno
import itertools
import logging
import os
import resource
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from colibrid import __version__
from colibrid.daemon.access import AccessPolicy, PeerCredentials, may_administer, peer_credentials
from colibrid.daemon.listener import Listener
from colibrid.wire.errors import ProtocolError, RequestId
from colibrid.wire.events import (
    DoneEvent, ErrorEvent, Event, HelloEvent, ModelsEvent, OkEvent, StatusEvent, SubscribedEvent, UnsubscribedEvent,
    VerifiedEvent, VerifyDamageEvent, VerifyProgressEvent,
)
from colibrid.wire.frames import LENGTH_PREFIX, PROTOCOL_VERSION, decode_request_body, encode_frame, request_body_length
from colibrid.wire.requests import (
    Ask, Cancel, Hello, Models, Request, Status, Subscribe, Verify, is_request_id, parse_request,
)
from colibrid.daemon.routing_stream import Subscription, TooManySubscribers
from colibrid.daemon.verify_request import DEFAULT_BACKGROUND_MB_PER_S, PackVerification, VerifyBusy, VerifyRun
from colibrid.daemon.engine_loop import (
    STOP_CANCELLED, STOP_DISCONNECTED, EngineLoop, IntakeClosed, Job, QueueFull, cancelled_done,
    shutdown_error,
)

log = logging.getLogger(__name__)

SERVER_NAME = f"colibrid {__version__}"  # what `hello` says the server is
# How long a closing connection may take to hand its last frames to the kernel; a client that
# stopped reading must not hold the daemon's shutdown (or its own slot) forever.
FLUSH_TIMEOUT_S = 5.0
# How long shutdown waits for the engine thread to reach the end of its current token. A long
# prompt's prefill cannot be interrupted; past this the daemon exits anyway (the thread is a daemon).
WORKER_STOP_TIMEOUT_S = 10.0
# File descriptors the daemon needs besides its connections: the pack's files, the listening
# sockets, the event loop, the thermal watch, the log. max_connections must leave room for them.
FDS_BESIDES_CONNECTIONS = 64
# Warnings a client can provoke at will (refused connections, accept failures) are logged at
# most once per this interval, with a count: a flood must not turn into a flood of log lines.
REPEATED_WARNING_INTERVAL_S = 10.0
# accept() errors that mean "out of a resource", not "this one connection failed": accepting
# pauses for ACCEPT_RETRY_S (the kernel keeps the listening socket readable, so retrying at
# once would spin), and the waiting clients stay in the backlog meanwhile.
ACCEPT_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
ACCEPT_RETRY_S = 1.0
# Connections accepted per wake-up of a listening socket before the loop serves the others.
ACCEPT_BATCH = 64
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


class RepeatedWarning:
    """A warning logged at most once per REPEATED_WARNING_INTERVAL_S, saying how many it stands for."""

    def __init__(self, interval_s: float = REPEATED_WARNING_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.count = 0  # occurrences since start, for status
        self._unreported = 0
        self._last_logged_s: float | None = None

    def warn(self, message: str, *args: Any) -> None:
        self.count += 1
        self._unreported += 1
        now = time.monotonic()
        if self._last_logged_s is not None and now - self._last_logged_s < self.interval_s:
            return
        if self._unreported > 1:
            message += f" ({self._unreported} times in the last {now - self._last_logged_s:.0f} s)"
        log.warning(message, *args)
        self._last_logged_s, self._unreported = now, 0


def raise_open_files_limit(max_connections: int) -> int:
    """Raise RLIMIT_NOFILE's soft limit to the hard one (logged); warn if max_connections does not
    fit under it. Returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            log.info("open files limit raised from %d to %d (the hard limit)", soft, hard)
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open files limit from %d to %d: %s", soft, hard, exc)
    if soft != resource.RLIM_INFINITY and max_connections + FDS_BESIDES_CONNECTIONS > soft:
        log.warning("max_connections %d and the daemon's own ~%d files need more than the open files limit %d: "
                    "past about %d connections new clients wait unanswered; raise LimitNOFILE= or lower "
                    "max_connections", max_connections, FDS_BESIDES_CONNECTIONS, soft,
                    max(0, soft - FDS_BESIDES_CONNECTIONS))
    return soft


class ClientTooSlow(Exception):
    """The client left more than max_outbox_bytes unread for stalled_client_timeout_s."""


def model_name(pack_path: Path) -> str:
    """What clients call the model: the pack directory's name without a `.pack` suffix."""
    return pack_path.name.removesuffix(".pack") or str(pack_path)


def describe_model(engine, pack_path: Path) -> dict[str, Any]:
    """One entry of the `models` event; `status` carries the same fields."""
    return {
        "name": model_name(pack_path),
        "path": str(pack_path),
        "architecture": engine.config.architecture,
        "parameters_total": engine.parameters_total,
        "parameters_active": engine.parameters_active,
        "quantization": dict(engine.pack.manifest.quantization),
        "sampling_defaults": dict(engine.sampling_defaults),  # from generation_config.json
    }


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


class Server:
    """Configured through its constructor, and on reload through reconfigure(); the daemon
    never sets its fields. ``machine`` (cpus, nice) and ``shown_settings`` (the daemon's
    reloadable settings) are only shown by status; ``thermal`` is the daemon's ThermalWatch,
    whose status() and status_line() status and STATUS= include."""

    def __init__(self, engine, engine_loop: EngineLoop, pack_path: Path, settings: ServerSettings | None = None,
                 shown_settings: dict[str, Any] | None = None, machine: dict[str, Any] | None = None,
                 thermal=None) -> None:
        self.engine = engine
        self.engine_loop = engine_loop
        self.model = describe_model(engine, pack_path)
        # Replaced as a whole on reload; a connection reads it when it needs a value.
        self.settings = settings or ServerSettings()
        self._shown_settings = dict(shown_settings or {})
        self._machine = dict(machine or {})
        self._thermal = thermal
        self._token_rate = _TokenRate(engine_loop)
        self.started_s = time.monotonic()
        self._connections: set[Connection] = set()
        self._connection_numbers = itertools.count(1)
        self._listener_sockets: list[socket.socket] = []  # those we accept on
        self._accept_retry: asyncio.TimerHandle | None = None  # set while accepting is paused
        self._connection_tasks: set[asyncio.Task] = set()
        self._listening: list[dict[str, Any]] = []
        self._refused_busy = RepeatedWarning()
        self._accept_failures = RepeatedWarning()
        self.verification = PackVerification(
            engine.pack, busy=lambda: engine_loop.requests_running + engine_loop.queue_depth > 0,
            io_queue_depth=lambda: max(1, int(engine.cache_status().get("io_queue_depth", 1))))

    def reconfigure(self, settings: ServerSettings, shown_settings: dict[str, Any]) -> None:
        """A reload: new settings from the next frame, connection and check on."""
        self.settings = settings
        self._shown_settings = dict(shown_settings)

    def sample_token_rate(self) -> float:
        """Tokens per second generated since the previous call (the daemon calls this every few
        seconds for STATUS=); status shows the last value as recent_tokens_per_s."""
        return self._token_rate.sample()

    async def start(self, listeners: list[Listener]) -> None:
        raise_open_files_limit(self.settings.limits.max_connections)
        for listener in listeners:
            listener.sock.setblocking(False)
            self._listener_sockets.append(listener.sock)
            self._listening.append({"address": listener.address, "inherited": listener.inherited})
        self._resume_accepting()

    def stop_accepting(self) -> None:
        loop = asyncio.get_running_loop()
        if self._accept_retry is not None:
            self._accept_retry.cancel()
            self._accept_retry = None
        for sock in self._listener_sockets:
            if sock.fileno() >= 0:
                loop.remove_reader(sock.fileno())
        self._listener_sockets = []

    # -- accepting -------------------------------------------------------------------------
    # Our own accept loop rather than asyncio.start_unix_server's: out of file descriptors,
    # that one logs a traceback per failed accept (over a thousand a second here) and keeps
    # retrying on a timer even after the server is closed.

    def _resume_accepting(self) -> None:
        self._accept_retry = None
        loop = asyncio.get_running_loop()
        for sock in self._listener_sockets:
            loop.add_reader(sock.fileno(), self._accept, sock)

    def _pause_accepting(self, exc: OSError) -> None:
        loop = asyncio.get_running_loop()
        for sock in self._listener_sockets:
            loop.remove_reader(sock.fileno())
        self._accept_retry = loop.call_later(ACCEPT_RETRY_S, self._resume_accepting)
        self._accept_failures.warn(
            "cannot accept connections: %s (%d connections open); new clients wait until some close. "
            "Raise LimitNOFILE= or lower max_connections (%d)", exc.strerror, len(self._connection_tasks),
            self.settings.limits.max_connections)

    def _accept(self, listening: socket.socket) -> None:
        if listening.fileno() < 0:
            return  # closed under us (a failed start-up closes its listeners): nothing to accept
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _ = listening.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return  # nobody else is waiting
            except OSError as exc:
                if exc.errno not in ACCEPT_RESOURCE_ERRNOS:
                    raise
                self._pause_accepting(exc)
                return
            sock.setblocking(False)
            task = asyncio.get_running_loop().create_task(self._serve_socket(sock))
            self._connection_tasks.add(task)
            task.add_done_callback(self._connection_ended)

    def _connection_ended(self, task: asyncio.Task) -> None:
        self._connection_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("a connection failed unexpectedly", exc_info=task.exception())

    async def _serve_socket(self, sock: socket.socket) -> None:
        try:
            reader, writer = await asyncio.open_unix_connection(sock=sock)
        except OSError as exc:  # out of memory or descriptors for the event loop's own needs
            log.debug("could not set up an accepted connection: %s", exc)
            sock.close()
            return
        await self._serve_connection(reader, writer)

    async def drain(self, grace_s: float, cut_short: asyncio.Event) -> None:
        """Let accepted requests finish for up to grace_s (or until cut_short is set); refuse new ones."""
        self.stop_accepting()
        self.engine_loop.close_intake()
        busy = self.engine_loop.requests_running + self.engine_loop.queue_depth
        if busy == 0 or grace_s <= 0:
            return
        log.info("draining: %d request(s) may finish within %.0f s", busy, grace_s)
        worker_done = asyncio.create_task(asyncio.to_thread(self.engine_loop.join, grace_s))
        cut = asyncio.create_task(cut_short.wait())
        await asyncio.wait([worker_done, cut], return_when=asyncio.FIRST_COMPLETED)
        cut.cancel()
        if worker_done.done() and worker_done.result():
            log.info("drained: every accepted request finished")
        # else: stop() ends what is left with `shutdown`; the thread in to_thread returns by itself

    async def stop(self) -> None:
        """Stop accepting, end every open request with `shutdown`, flush and close every connection."""
        self.stop_accepting()
        await asyncio.to_thread(self.verification.shutdown, WORKER_STOP_TIMEOUT_S)
        for job in self.engine_loop.stop():
            job.emit(shutdown_error(job))
        if not await asyncio.to_thread(self.engine_loop.join, WORKER_STOP_TIMEOUT_S):
            log.warning("the engine thread did not stop within %.0f s; exiting without it", WORKER_STOP_TIMEOUT_S)
        await asyncio.sleep(0)  # the worker's last events are queued on the loop; let them reach the outboxes
        for connection in list(self._connections):
            connection.end_subscriptions("shutdown")
        await asyncio.gather(*(connection.close() for connection in list(self._connections)))
        leftover = [task for task in self._connection_tasks if not task.done()]  # accepted as we stopped
        for task in leftover:
            task.cancel()
        await asyncio.gather(*leftover, return_exceptions=True)

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._connections) >= self.settings.limits.max_connections and not _from_this_process(writer):
            await self._refuse_busy(writer)
            return
        connection = Connection(self, reader, writer, next(self._connection_numbers))
        self._connections.add(connection)
        try:
            await connection.serve()
        finally:
            self._connections.discard(connection)

    async def _refuse_busy(self, writer: asyncio.StreamWriter) -> None:
        """One `busy` error (id null), then close: the client learns at once instead of hanging."""
        limit = self.settings.limits.max_connections
        self._refused_busy.warn("refused a connection: %d are open (max_connections)", limit)
        writer.write(encode_frame(ErrorEvent(None, "busy", f"colibrid serves at most {limit} connections at once "
                                                            "(max_connections); try again later").to_wire()))
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), 1.0)
        except (asyncio.TimeoutError, ConnectionError, OSError):
            pass
        writer.transport.abort()

    # -- replies that need the whole daemon's view ---------------------------------------

    def status_event(self, request_id: RequestId) -> StatusEvent:
        cache = self.engine.cache_status()
        memory_budget = self.engine.memory_budget()
        return StatusEvent(request_id, {
            "model": self.model["name"], "path": self.model["path"], "architecture": self.model["architecture"],
            "parameters_total": self.model["parameters_total"], "parameters_active": self.model["parameters_active"],
            "quantization": self.model["quantization"], "sampling_defaults": self.model["sampling_defaults"],
            "memory": {"rss_bytes": psutil.Process().memory_info().rss,
                       "dense_bytes": self.engine.pack.manifest.dense_size},
            "pack_notes": list(self.engine.pack.notes),  # e.g. an old pack without dense checksums
            "pack_damage": self.engine.pack.damage.status(),  # expert records found damaged
            "verify": self.verification.status(),
            "cache": cache,
            "uptime_s": time.monotonic() - self.started_s,
            "requests_served": self.engine_loop.requests_served,
            "recent_tokens_per_s": self._token_rate.recent_per_s,
            "requests_running": self.engine_loop.requests_running,
            "running": self.engine_loop.running_status(),
            "batch": self.engine_loop.batch_status(),
            "kv_cache": self.engine_loop.kv_status(),
            "prefix_cache": self.engine_loop.prefix_cache_status(),
            "queue_depth": self.engine_loop.queue_depth,
            "queue_limit": self.engine_loop.max_queue,
            "version": __version__,
            "listening": self._listening,
            "connections": {"open": len(self._connections), "limit": self.settings.limits.max_connections,
                            "refused_busy": self._refused_busy.count,
                            "accept_failures": self._accept_failures.count},
            **({"thermal": self._thermal.status()} if self._thermal is not None else {}),
            **self._machine,
            **({"memory_budget": memory_budget} if memory_budget is not None else {}),
            "settings": dict(self._shown_settings),
        })

    def service_status(self, recent_tokens_per_s: float) -> str:
        """The one line systemd shows as `Status:` (STATUS=): what is served and how it is going."""
        cache = self.engine.cache_status()
        hits, misses = cache["hits"], cache["misses"]
        hit_rate = f"{100 * hits / (hits + misses):.0f}% expert hits" if hits + misses else "no experts loaded yet"
        if "slots" in cache:
            hit_rate = f"cache {cache['resident_slots']}/{cache['slots']} experts, {hit_rate}"
        thermal = f"; {self._thermal.status_line()}" if self._thermal is not None else ""
        return (f"serving {self.model['name']}: {self.engine_loop.requests_running} running, "
                f"{self.engine_loop.queue_depth} waiting, {self.engine_loop.requests_served} served; "
                f"{recent_tokens_per_s:.1f} tokens/s recently; {hit_rate}{thermal}")

    def hello_event(self, request_id: RequestId) -> HelloEvent:
        return HelloEvent(request_id, PROTOCOL_VERSION, SERVER_NAME, self.model["name"], self.settings.max_frame_bytes)


class _TokenRate:
    """The engine loop's tokens per second between two samples."""

    def __init__(self, engine_loop: EngineLoop) -> None:
        self._engine_loop = engine_loop
        self._tokens_before, self._time_before_s = engine_loop.tokens_generated, time.monotonic()
        self.recent_per_s = 0.0

    def sample(self) -> float:
        tokens, now_s = self._engine_loop.tokens_generated, time.monotonic()
        elapsed_s = now_s - self._time_before_s
        if elapsed_s > 0:
            self.recent_per_s = (tokens - self._tokens_before) / elapsed_s
        self._tokens_before, self._time_before_s = tokens, now_s
        return self.recent_per_s


def _from_this_process(writer: asyncio.StreamWriter) -> bool:
    """The daemon's own start-up check (a hello to itself) is never refused for want of room:
    clients that crowd the socket first must not be able to make it fail to start."""
    peer = peer_credentials(writer.get_extra_info("socket"))
    return peer is not None and peer.pid == os.getpid()


def _drop_event(event: Event) -> None:
    """A Job's emit until its connection provides the real one."""


def _ignore(*_: Any) -> None:
    """What a background verify reports as it goes: nobody listens (status shows it)."""


class Connection:
    """One client: its open asks, its outbox, and the tasks that read and write its socket."""

    def __init__(self, server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
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
            request_id = message.get("id")
            log.warning("%s refused: not in allow_users or allow_groups", self.name)
            raise ProtocolError("forbidden", "this user may not use colibrid (allow_users / allow_groups in its "
                                "config)", request_id if is_request_id(request_id) else None)
        if not self._greeted and message.get("op") != "hello":
            request_id = message.get("id")
            raise ProtocolError("bad_request", "the first request on a connection must be hello",
                                request_id if is_request_id(request_id) else None)
        request = parse_request(message, self.server.settings.default_max_tokens, self.server.model["sampling_defaults"])
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
        self.send(SubscribedEvent(request.id, request.stream, stream.capture.moe_layers, stream.capture.num_experts,
                                   self.server.engine.config.num_experts_per_tok))

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
