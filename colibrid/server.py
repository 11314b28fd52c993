"""The server: accepts connections on the Unix socket and speaks docs/protocol.md on each.

Each connection has a reader (frames in -> requests) and a writer (an outbox of encoded frames
-> the socket). Replies never write to the socket directly: they go into the outbox, so a
client that reads slowly only grows its own outbox (bounded by the tokens it asked for) and
never blocks the engine thread or another client. A connection that breaks the protocol gets
one `error` and is closed; nothing it sends can reach the other connections.

Each connection's peer credentials (SO_PEERCRED) are read when it is accepted, named in every
log line about it, and checked against allow_users / allow_groups; a refused peer's first
request is answered with `forbidden` and the connection is closed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from pathlib import Path
from typing import Any

import psutil

from colibrid import __version__
from colibrid.access import AccessPolicy, PeerCredentials, peer_credentials
from colibrid.listener import Listener
from colibrid.protocol import (
    LENGTH_PREFIX, PROTOCOL_VERSION, SERVER_NAME, Ask, Cancel, Hello, Models, ProtocolError, Request, RequestId,
    Status, body_length, decode_body, encode_frame, error_event, is_request_id, parse_request,
)
from colibrid.scheduler import (
    STOP_CANCELLED, STOP_DISCONNECTED, Event, Job, QueueFull, Scheduler, SchedulerStopped, cancelled_done,
    shutdown_error,
)

log = logging.getLogger(__name__)

# How long a closing connection may take to hand its last frames to the kernel; a client that
# stopped reading must not hold the daemon's shutdown (or its own slot) forever.
FLUSH_TIMEOUT_S = 5.0
# How long shutdown waits for the engine thread to reach the end of its current token. A long
# prompt's prefill cannot be interrupted; past this the daemon exits anyway (the thread is a daemon).
WORKER_STOP_TIMEOUT_S = 10.0


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


class Server:
    def __init__(self, engine, scheduler: Scheduler, pack_path: Path, max_frame_bytes: int,
                 default_max_tokens: int, access: AccessPolicy | None = None) -> None:
        self.engine = engine
        self.scheduler = scheduler
        self.model = describe_model(engine, pack_path)
        # These three may be replaced on reload; a connection reads them when it needs them.
        self.max_frame_bytes = max_frame_bytes
        self.default_max_tokens = default_max_tokens
        self.access = access or AccessPolicy()
        self.machine: dict[str, Any] = {}  # what status shows of the daemon's setup (cpus, nice, ...)
        self.thermal = None  # the daemon's ThermalWatch, once started: status() and status_line()
        self.started_s = time.monotonic()
        self._connections: set[Connection] = set()
        self._connection_numbers = itertools.count(1)
        self._asyncio_servers: list[asyncio.AbstractServer] = []
        self._listening: list[dict[str, Any]] = []

    async def start(self, listeners: list[Listener]) -> None:
        for listener in listeners:
            self._asyncio_servers.append(await asyncio.start_unix_server(self._serve_connection, sock=listener.sock))
            self._listening.append({"address": listener.address, "inherited": listener.inherited})

    def stop_accepting(self) -> None:
        for asyncio_server in self._asyncio_servers:
            asyncio_server.close()

    async def drain(self, grace_s: float, cut_short: asyncio.Event) -> None:
        """Let accepted requests finish for up to grace_s (or until cut_short is set); refuse new ones."""
        self.stop_accepting()
        self.scheduler.close_intake()
        busy = self.scheduler.requests_running + self.scheduler.queue_depth
        if busy == 0 or grace_s <= 0:
            return
        log.info("draining: %d request(s) may finish within %.0f s", busy, grace_s)
        worker_done = asyncio.create_task(asyncio.to_thread(self.scheduler.join, grace_s))
        cut = asyncio.create_task(cut_short.wait())
        await asyncio.wait([worker_done, cut], return_when=asyncio.FIRST_COMPLETED)
        cut.cancel()
        if worker_done.done() and worker_done.result():
            log.info("drained: every accepted request finished")
        # else: stop() ends what is left with `shutdown`; the thread in to_thread returns by itself

    async def stop(self) -> None:
        """Stop accepting, end every open request with `shutdown`, flush and close every connection."""
        self.stop_accepting()
        for job in self.scheduler.stop():
            job.emit(shutdown_error(job))
        if not await asyncio.to_thread(self.scheduler.join, WORKER_STOP_TIMEOUT_S):
            log.warning("the engine thread did not stop within %.0f s; exiting without it", WORKER_STOP_TIMEOUT_S)
        await asyncio.sleep(0)  # the worker's last events are queued on the loop; let them reach the outboxes
        await asyncio.gather(*(connection.close() for connection in list(self._connections)))

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = Connection(self, reader, writer, next(self._connection_numbers))
        self._connections.add(connection)
        try:
            await connection.serve()
        finally:
            self._connections.discard(connection)

    # -- replies that need the whole daemon's view ---------------------------------------

    def status_event(self, request_id: RequestId) -> Event:
        cache = self.engine.experts.summary()
        return {
            "event": "status", "id": request_id,
            "model": self.model["name"], "path": self.model["path"], "architecture": self.model["architecture"],
            "parameters_total": self.model["parameters_total"], "parameters_active": self.model["parameters_active"],
            "quantization": self.model["quantization"], "sampling_defaults": self.model["sampling_defaults"],
            "memory": {"rss_bytes": psutil.Process().memory_info().rss,
                       "dense_bytes": self.engine.pack.manifest.dense_size},
            "pack_notes": list(self.engine.pack.notes),  # e.g. an old pack without dense checksums
            "cache": cache,
            "uptime_s": time.monotonic() - self.started_s,
            "requests_served": self.scheduler.requests_served,
            "requests_running": self.scheduler.requests_running,
            "queue_depth": self.scheduler.queue_depth,
            "queue_limit": self.scheduler.max_queue,
            "version": __version__,
            "listening": self._listening,
            **({"thermal": self.thermal.status()} if self.thermal is not None else {}),
            **self.machine,
        }

    def service_status(self, recent_tokens_per_s: float) -> str:
        """The one line systemd shows as `Status:` (STATUS=): what is served and how it is going."""
        cache = self.engine.experts.summary()
        hits, misses = cache["hits"], cache["misses"]
        hit_rate = f"{100 * hits / (hits + misses):.0f}% expert hits" if hits + misses else "no experts loaded yet"
        if "slots" in cache:
            hit_rate = f"cache {cache['resident_slots']}/{cache['slots']} experts, {hit_rate}"
        thermal = f"; {self.thermal.status_line()}" if self.thermal is not None else ""
        return (f"serving {self.model['name']}: {self.scheduler.requests_running} running, "
                f"{self.scheduler.queue_depth} waiting, {self.scheduler.requests_served} served; "
                f"{recent_tokens_per_s:.1f} tokens/s recently; {hit_rate}{thermal}")

    def hello_event(self, request_id: RequestId) -> Event:
        return {"event": "hello", "id": request_id, "protocol": PROTOCOL_VERSION, "server": SERVER_NAME,
                "model": self.model["name"], "max_frame_bytes": self.max_frame_bytes}


def _drop_event(event: Event) -> None:
    """A Job's emit until its connection provides the real one."""


class Connection:
    """One client: its open asks, its outbox, and the tasks that read and write its socket."""

    def __init__(self, server: Server, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 number: int) -> None:
        self.server = server
        self.number = number  # for the log only
        self.peer: PeerCredentials | None = peer_credentials(writer.get_extra_info("socket"))
        self.name = f"connection {number} ({self.peer.describe() if self.peer else 'peer unknown'})"
        self._reader = reader
        self._writer = writer
        self._loop = asyncio.get_running_loop()
        self._outbox: asyncio.Queue[bytes | None] = asyncio.Queue()  # None: flush and close
        self._open_asks: dict[RequestId, Job] = {}
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
            self.server.scheduler.withdraw(job, STOP_DISCONNECTED)
        self._open_asks.clear()
        self._closed = True
        self._outbox.put_nowait(None)
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
        while True:
            try:
                message = await self._read_frame()
                if message is None:
                    return  # the client closed the connection between frames
                self._handle(message)
            except ProtocolError as exc:
                log.debug("%s: %s: %s", self.name, exc.code, exc.message)
                self.send(error_event(exc.request_id, exc.code, exc.message))
                if exc.closes_connection:
                    return

    async def _read_frame(self) -> dict[str, Any] | None:
        try:
            prefix = await self._reader.readexactly(LENGTH_PREFIX.size)
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                return None
            raise ProtocolError("bad_frame", "connection closed in the middle of a length prefix") from None
        length = body_length(prefix, self.server.max_frame_bytes)  # checked before reading: never allocate it
        try:
            body = await self._reader.readexactly(length)
        except asyncio.IncompleteReadError as exc:
            raise ProtocolError("bad_frame", f"connection closed after {len(exc.partial)} of {length} bytes "
                                             "of a frame") from None
        return decode_body(body)

    def _handle(self, message: dict[str, Any]) -> None:
        if not self.server.access.allows(self.peer):
            request_id = message.get("id")
            log.warning("%s refused: not in allow_users or allow_groups", self.name)
            raise ProtocolError("forbidden", "this user may not use colibrid (allow_users / allow_groups in its "
                                "config)", request_id if is_request_id(request_id) else None)
        if not self._greeted and message.get("op") != "hello":
            request_id = message.get("id")
            raise ProtocolError("bad_request", "the first request on a connection must be hello",
                                request_id if is_request_id(request_id) else None)
        request = parse_request(message, self.server.default_max_tokens, self.server.model["sampling_defaults"])
        if request.id in self._open_asks:
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
        elif isinstance(request, Status):
            self.send(self.server.status_event(request.id))
        elif isinstance(request, Models):
            self.send({"event": "models", "id": request.id, "models": [self.server.model]})

    def _submit(self, ask: Ask) -> None:
        log.debug("%s: ask %r, max_tokens %d", self.name, ask.id, ask.params.max_tokens)
        job = Job(ask, emit=_drop_event, origin=self.name)
        job.emit = self._emitter(job)
        self._open_asks[ask.id] = job
        try:
            self.server.scheduler.submit(job)
        except QueueFull:
            self._deliver(job, error_event(ask.id, "busy", f"the queue is full ({self.server.scheduler.max_queue} "
                                                           "requests waiting); try again later"))
        except SchedulerStopped:
            self._deliver(job, shutdown_error(job))

    def _cancel(self, cancel: Cancel) -> None:
        job = self._open_asks.get(cancel.target)
        if job is None:
            raise ProtocolError("unknown_request", f"no open ask with id {cancel.target!r} on this connection",
                                cancel.id)
        self.send({"event": "ok", "id": cancel.id})
        if self.server.scheduler.withdraw(job, STOP_CANCELLED):
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
        if event["event"] in ("done", "error") and self._open_asks.get(job.ask.id) is job:
            del self._open_asks[job.ask.id]
        self.send(event)

    def send(self, event: Event) -> None:
        if not self._closed:
            self._outbox.put_nowait(encode_frame(event))

    async def _write_frames(self) -> None:
        try:
            while (frame := await self._outbox.get()) is not None:
                self._writer.write(frame)
                await self._writer.drain()
        except (ConnectionError, OSError) as exc:
            log.debug("%s: write failed: %s", self.name, exc)
            self._closed = True
            if self._read_task is not None:
                self._read_task.cancel()  # the client is gone: stop waiting for its requests
