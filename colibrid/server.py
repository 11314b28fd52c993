"""The server: accepts connections on the Unix socket and speaks docs/protocol.md on each.

Each connection has a reader (frames in -> requests) and a writer (an outbox of encoded frames
-> the socket). Replies never write to the socket directly: they go into the outbox, so a
client that reads slowly only grows its own outbox (bounded by the tokens it asked for) and
never blocks the engine thread or another client. A connection that breaks the protocol gets
one `error` and is closed; nothing it sends can reach the other connections.
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
from colibrid.listener import Listener
from colibrid.protocol import (
    LENGTH_PREFIX, PROTOCOL_VERSION, SERVER_NAME, Ask, Cancel, Hello, Models, ProtocolError, Request, RequestId,
    Status, body_length, decode_body, encode_frame, error_event, is_request_id, parse_request,
)
from colibrid.scheduler import (
    STOP_CANCELLED, STOP_DISCONNECTED, Event, Job, QueueFull, Scheduler, SchedulerStopped, cancelled_done,
    expert_counts, shutdown_error,
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
    }


class Server:
    def __init__(self, engine, scheduler: Scheduler, pack_path: Path, max_frame_bytes: int,
                 default_max_tokens: int) -> None:
        self.engine = engine
        self.scheduler = scheduler
        self.model = describe_model(engine, pack_path)
        self.max_frame_bytes = max_frame_bytes
        self.default_max_tokens = default_max_tokens
        self.started_s = time.monotonic()
        self._connections: set[Connection] = set()
        self._connection_numbers = itertools.count(1)
        self._asyncio_server: asyncio.AbstractServer | None = None

    async def start(self, listener: Listener) -> None:
        self._asyncio_server = await asyncio.start_unix_server(self._serve_connection, sock=listener.sock)

    async def stop(self) -> None:
        """Stop accepting, end every open request with `shutdown`, flush and close every connection."""
        if self._asyncio_server is not None:
            self._asyncio_server.close()
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
        stats = self.engine.experts.stats
        hits, misses = expert_counts(stats)
        return {
            "event": "status", "id": request_id,
            "model": self.model["name"], "path": self.model["path"], "architecture": self.model["architecture"],
            "parameters_total": self.model["parameters_total"], "parameters_active": self.model["parameters_active"],
            "quantization": self.model["quantization"],
            "memory": {"rss_bytes": psutil.Process().memory_info().rss,
                       "dense_bytes": self.engine.pack.manifest.dense_size},
            "cache": {"hits": hits, "misses": misses, "bytes_read": stats.bytes_read},
            "uptime_s": time.monotonic() - self.started_s,
            "requests_served": self.scheduler.requests_served,
            "requests_running": self.scheduler.requests_running,
            "queue_depth": self.scheduler.queue_depth,
            "queue_limit": self.scheduler.max_queue,
            "version": __version__,
        }

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
        log.debug("connection %d opened", self.number)
        self._serve_task = asyncio.current_task()
        self._write_task = asyncio.create_task(self._write_frames())
        self._read_task = asyncio.create_task(self._read_requests())
        try:
            await self._read_task
        except asyncio.CancelledError:
            pass  # stop() cancelled the reader: the daemon is shutting down
        except (ConnectionError, OSError) as exc:
            log.debug("connection %d: read failed: %s", self.number, exc)
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
            log.debug("connection %d: client stopped reading; dropping its unsent frames", self.number)
        except (ConnectionError, OSError):
            pass  # the client is gone already
        self._writer.transport.abort()
        log.debug("connection %d closed", self.number)

    # -- reading ---------------------------------------------------------------------------

    async def _read_requests(self) -> None:
        while True:
            try:
                message = await self._read_frame()
                if message is None:
                    return  # the client closed the connection between frames
                self._handle(message)
            except ProtocolError as exc:
                log.debug("connection %d: %s: %s", self.number, exc.code, exc.message)
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
        if not self._greeted and message.get("op") != "hello":
            request_id = message.get("id")
            raise ProtocolError("bad_request", "the first request on a connection must be hello",
                                request_id if is_request_id(request_id) else None)
        request = parse_request(message, self.server.default_max_tokens)
        if request.id in self._open_asks:
            raise ProtocolError("bad_request", f"id {request.id!r} is already open on this connection", request.id)
        self._dispatch(request)

    def _dispatch(self, request: Request) -> None:
        if isinstance(request, Hello):
            self._greeted = True
            log.debug("connection %d: hello from %s", self.number, request.client or "an unnamed client")
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
        job = Job(ask, emit=_drop_event)
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
            log.debug("connection %d: write failed: %s", self.number, exc)
            self._closed = True
            if self._read_task is not None:
                self._read_task.cancel()  # the client is gone: stop waiting for its requests
