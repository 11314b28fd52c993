"""The server: accepts connections on the Unix socket and serves each with a Connection
(colibrid/daemon/connection.py, which speaks docs/protocol.md on it).

The number of clients is bounded: past max_connections a new one gets `busy` and is closed,
well before the daemon runs out of file descriptors (which is logged once per interval). The
server also makes the replies that need the whole daemon's view (hello, status, subscribed),
drains and stops: on shutdown every open request ends with `shutdown` and every connection is
flushed and closed.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import os
import resource
import socket
import time
from pathlib import Path
from typing import Any

from colibrid import __version__
from colibrid.daemon.access import peer_credentials
from colibrid.daemon.connection import Connection, ServerSettings
from colibrid.daemon.engine_loop import EngineLoop, shutdown_error
from colibrid.daemon.listener import Listener
from colibrid.daemon.residency import ResidentSplit
from colibrid.daemon.verify_request import PackVerification
from colibrid.wire.errors import RequestId
from colibrid.wire.events import ErrorEvent, HelloEvent, StatusEvent, SubscribedEvent
from colibrid.wire.frames import PROTOCOL_VERSION, encode_frame

log = logging.getLogger(__name__)

SERVER_NAME = f"colibrid {__version__}"  # what `hello` says the server is
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
    """Configured through its constructor, and on reload through reconfigure(); the daemon
    never sets its fields. ``machine`` (cpus, nice) and ``shown_settings`` (the daemon's
    reloadable settings) are only shown by status; ``thermal`` is the daemon's ThermalWatch,
    whose status() and status_line() status and STATUS= include."""

    def __init__(self, engine, engine_loop: EngineLoop, pack_path: Path, settings: ServerSettings | None = None,
                 shown_settings: dict[str, Any] | None = None, machine: dict[str, Any] | None = None,
                 thermal=None) -> None:
        self.engine = engine
        self.engine_loop = engine_loop
        self._resident = ResidentSplit(engine)
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
        kv_cache, prefix_cache = self.engine_loop.kv_status(), self.engine_loop.prefix_cache_status()
        resident = self._resident.split(kv_in_use_bytes=int(kv_cache["used_bytes"]),
                                        prefix_cache_in_use_bytes=int(prefix_cache.get("used_bytes", 0)))
        return StatusEvent(request_id, {
            "model": self.model["name"], "path": self.model["path"], "architecture": self.model["architecture"],
            "parameters_total": self.model["parameters_total"], "parameters_active": self.model["parameters_active"],
            "quantization": self.model["quantization"], "sampling_defaults": self.model["sampling_defaults"],
            "memory": {"dense_bytes": self.engine.pack.manifest.dense_size, **resident},
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
            "kv_cache": kv_cache,
            "prefix_cache": prefix_cache,
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

    def subscribed_event(self, request_id: RequestId, stream: str) -> SubscribedEvent:
        """The first event of a subscription: the model's routing shape, for drawing what follows."""
        capture = self.engine_loop.routing.capture
        return SubscribedEvent(request_id, stream, capture.moe_layers, capture.num_experts,
                               self.engine.config.num_experts_per_tok)


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


