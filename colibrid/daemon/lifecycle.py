"""colibrid: the daemon's lifecycle, in named phases.

    run()      config -> logging -> asyncio.run(serve())           exit code
    startup    check that no daemon answers on the socket, give back hugepages an earlier colibrid
               raised and never returned, niceness and CPUs, load the engine, open the socket(s), start the engine
               thread and the server, find the NVMe drive under the pack and start the thermal
               watch (colibrid/thermal), check that the socket answers, then READY=1
    main loop  wait for SIGTERM/SIGINT (stop) or SIGHUP (reload the config, not the model)
    shutdown   STOPPING=1; refuse new requests, let accepted ones finish for shutdown_grace_s,
               end the rest with `shutdown`, close connections, remove the socket

Signal handlers only set flags (asyncio.Events); everything else happens in the phases, where
it can be ordered and logged. They are installed before anything else, so that a SIGTERM or a
SIGHUP during a long model load is handled when the load ends, not fatal. A second SIGTERM
during the drain ends the grace period at once.

systemd (docs/systemd.md) hears of each phase through sd_notify: STATUS= lines while starting
and serving, READY=1, RELOADING=1 ... READY=1 around a reload, STOPPING=1, and WATCHDOG=1 while
the engine is healthy. Without NOTIFY_SOCKET all of that is silently skipped.

Exit codes: 0 after a clean stop, 1 if startup failed (the model or the socket), 2 for a
configuration error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import sys
from collections.abc import Sequence

from colibrid.system import affinity
from colibrid.daemon.config import KEYS, ConfigError, DaemonConfig, load_config
from colibrid.daemon.listener import Listener, ListenerError, check_free, open_listeners
from colibrid.system.logsetup import configure_logging, set_level
from colibrid.sizes import format_bytes
from colibrid.system.cache_memory import MachineMemory
from colibrid.system.memory import HugepageRecord, measure_budget, parse_size, return_orphaned_hugepages
from colibrid.wire.errors import ProtocolViolation
from colibrid.wire.events import Event, HelloEvent, event_from_wire
from colibrid.wire.frames import LENGTH_PREFIX, PROTOCOL_VERSION, decode_event_body, encode_frame, event_body_length
from colibrid.wire.requests import Hello
from colibrid.daemon.engine_loop import EngineLoop
from colibrid.daemon.connection import ClientLimits, ServerSettings
from colibrid.daemon.server import Server, model_name
from colibrid.system.systemd_notify import Notifier, watchdog_interval_s
from colibrid.thermal.watch import ThermalSettings, ThermalWatch
from colibrid.daemon.watchdog import Watchdog

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_STARTUP_FAILED = 1
EXIT_CONFIG_ERROR = 2

# How often STATUS= is refreshed (only sent when the line changed), and the window of its tokens/s.
STATUS_INTERVAL_S = 2.0
# The self-check before READY=1: our own hello must come back within this.
SELF_CHECK_TIMEOUT_S = 10.0


class StartupError(Exception):
    """The daemon cannot start; str() is the one line that says why."""


def _count(parameters: int) -> str:
    """6.92B, 14.7M: how model sizes are usually said."""
    return f"{parameters / 1e9:.2f}B" if parameters >= 1e9 else f"{parameters / 1e6:.1f}M"


class Daemon:
    def __init__(self, config: DaemonConfig, argv: Sequence[str]) -> None:
        self.config = config
        self._argv = list(argv)  # read again on reload: flags keep overriding the file
        self._notifier = Notifier()
        self._cpus: affinity.CpuPlan | None = None  # planned at startup
        self._kv_budget_line = ""  # what kv_cache_size came to, logged once serving
        self._prefix_cache_line = ""  # what prefix_cache_size came to, likewise
        interval_s = watchdog_interval_s()
        self._watchdog = Watchdog(self._notifier, interval_s, config.stall_timeout_s) if interval_s else None
        # Set by signal handlers, and only there.
        self._stop_requested = asyncio.Event()
        self._stop_now = asyncio.Event()  # a second stop signal: end the drain at once
        self._reload_requested = asyncio.Event()
        self._listeners: list[Listener] = []
        self._engine_loop: EngineLoop | None = None
        self._server: Server | None = None
        self._engine = None  # once loaded; it frees its expert cache on every way out
        self._thermal: ThermalWatch | None = None
        self._background: list[asyncio.Task] = []

    # -- run ------------------------------------------------------------------------------

    async def serve(self) -> int:
        self._install_signal_handlers()
        if self._watchdog is not None:
            # From the very start: systemd's watchdog runs while we load the model too (the
            # load is bounded by TimeoutStartSec= instead).
            self._background.append(asyncio.create_task(self._watchdog.run()))
        try:
            await self.startup()
        except BaseException as exc:
            self._close_listeners()  # a half-started daemon must not leave its socket behind
            self._free_engine_after_failed_start()  # nor hugepages raised for its cache
            self._cancel_background()
            if not isinstance(exc, StartupError):
                raise
            log.error("%s", exc)
            self._notifier.status(f"failed to start: {exc}")
            return EXIT_STARTUP_FAILED
        try:
            await self.main_loop()
        finally:
            await self.shutdown()
        return EXIT_OK

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_stop_signal)
        loop.add_signal_handler(signal.SIGHUP, self._reload_requested.set)

    def _on_stop_signal(self) -> None:
        if self._stop_requested.is_set():
            self._stop_now.set()
        self._stop_requested.set()

    # -- startup --------------------------------------------------------------------------

    async def startup(self) -> None:
        # Before anything that costs the machine memory or changes it: a second colibrid on a
        # socket that is served gives up here, having touched nothing.
        try:
            check_free(self.config.socket)
        except ListenerError as exc:
            raise StartupError(str(exc)) from None
        return_orphaned_hugepages(HugepageRecord(self.config.hugepage_record))
        kv_budget_bytes = self._kv_budget_bytes()  # of the memory budget before the model takes its share
        prefix_cache_bytes = self._prefix_cache_bytes()
        self._notifier.status(f"loading {self.config.model}")
        nice = affinity.apply_nice(self.config.nice)  # before any thread exists: they all inherit it
        cpus = self._cpus = self._plan_cpus()
        # The loading thread and the engine thread are created while this thread runs on the
        # compute CPUs, so they and any native threads they start inherit that mask.
        affinity.pin_current_thread(cpus.compute)
        from colibrid import native  # imported here: it loads libcolibri

        # libcolibri's compute workers: one per compute CPU, each pinned to it.
        native.configure_default_pool(cpus=sorted(cpus.compute))
        engine = self._engine = await asyncio.to_thread(self._load_engine)
        try:
            self._listeners = open_listeners(self.config.socket, self.config.socket_group)
        except ListenerError as exc:
            raise StartupError(str(exc)) from None
        self._engine_loop = EngineLoop(engine, self.config.max_queue, self.config.max_batch, self.config.prefill_chunk,
                                       kv_budget_bytes, prefix_cache_bytes)
        self._engine_loop.start()
        affinity.pin_current_thread(cpus.io)  # the event loop and the threads it starts later
        await self._start_thermal_watch(engine)
        self._server = Server(engine, self._engine_loop, self.config.model, ServerSettings.from_config(self.config),
                              shown_settings=self._shown_settings(), machine={"cpus": cpus.describe(), "nice": nice},
                              thermal=self._thermal)
        await self._server.start(self._listeners)
        await self._check_socket_answers()
        if self._watchdog is not None:
            self._watchdog.engine_loop = self._engine_loop
        self._background.append(asyncio.create_task(self._report_status()))
        where = ", ".join(listener.address + (" (from systemd)" if listener.inherited else "")
                          for listener in self._listeners)
        log.info("serving %s (%s params, %s active) from %s on %s \u2014 stop with Ctrl-C or SIGTERM",
                 model_name(self.config.model), _count(engine.parameters_total),
                 _count(engine.parameters_active), self.config.model, where)
        self._log_budget(engine)
        log.info("%s", self._kv_budget_line)
        log.info("%s", self._prefix_cache_line)
        log.debug("compute threads on CPUs %s, I/O threads on CPUs %s", cpus.describe()["compute"],
                  cpus.describe()["io"])
        self._notifier.ready(self._server.service_status(0.0))

    def _kv_budget_bytes(self) -> int:
        """kv_cache_size in bytes; a percentage is of the memory budget measured now, before the
        dense weights and the expert cache take theirs (as cache_size's percentage is)."""
        budget = measure_budget()
        try:
            kv_bytes = parse_size(self.config.kv_cache_size, "kv_cache_size", budget.available_bytes)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        self._kv_budget_line = (f"KV cache budget {format_bytes(kv_bytes)} (kv_cache_size = {self.config.kv_cache_size} "
                                f"of the {budget.describe()}), keys and values as {self.config.kv_cache_type} "
                                "(kv_cache_type): a request joins the batch when its prompt plus max_tokens fits")
        return kv_bytes

    def _prefix_cache_bytes(self) -> int:
        """prefix_cache_size in bytes, a percentage of the memory budget as kv_cache_size's is."""
        budget = measure_budget()
        try:
            prefix_bytes = parse_size(self.config.prefix_cache_size, "prefix_cache_size", budget.available_bytes)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        if prefix_bytes == 0:
            self._prefix_cache_line = ("prefix reuse is off (prefix_cache_size = 0): every request prefills its "
                                       "whole prompt")
        else:
            self._prefix_cache_line = (f"prefix cache {format_bytes(prefix_bytes)} (prefix_cache_size = "
                                       f"{self.config.prefix_cache_size} of the {budget.describe()}): finished "
                                       "requests are kept so that the next turn of a chat prefills only what is new")
        return prefix_bytes

    async def _start_thermal_watch(self, engine) -> None:
        """Find the drive under the experts file and start watching it; from here on the watch
        sets the loader's queue depth and prefetch through the engine (the configured values
        when cool). A drive that comes back gets a cache on a fresh descriptor of the experts
        file (the old one died with the device), built between steps."""

        def reopen() -> None:
            if engine.rebuild_cache():
                self._log_cache(engine, "rebuilt on the experts file, reopened after its drive came back")

        self._thermal = ThermalWatch(engine.pack.experts_path, engine.limit_loading, self._thermal_settings(),
                                     on_drive_back=lambda: self._engine_loop.run_between_steps(reopen))
        await asyncio.to_thread(self._thermal.start)
        self._background.append(asyncio.create_task(self._thermal.run()))

    def _thermal_settings(self) -> ThermalSettings:
        c = self.config
        return ThermalSettings(mode=c.thermal, poll_s=c.thermal_poll_s, throttle=c.thermal_throttle,
                               resume=c.thermal_resume, io_queue_depth=c.io_queue_depth,
                               prefetch=c.prefetch == "lookahead")

    def _plan_cpus(self) -> affinity.CpuPlan:
        try:
            return affinity.plan_cpus(self.config.cpu_affinity, self.config.io_cpus, affinity.Topology.read())
        except affinity.CpuListError as exc:  # the config checked it; the cpuset can shrink in between
            raise StartupError(f"cannot pin threads: {exc}") from None

    def _cache_settings(self):
        """The expert cache as the config describes it, on this machine's memory (its budget
        measured at each build, hugepages raised as root and written down in hugepage_record);
        its loader threads run on the I/O CPUs."""
        from colibrid.engine.experts.cache import ExpertCacheSettings  # imported here: it loads libcolibri

        c = self.config
        return ExpertCacheSettings(cache_size=c.cache_size, policy=c.cache_policy, io_queue_depth=c.io_queue_depth,
                                   prefetch=c.prefetch == "lookahead", hugepages=c.hugepages,
                                   lock_memory=c.lock_memory, memory=MachineMemory(c.hugepage_record),
                                   loader_cpus=self._cpus.io if self._cpus is not None else None)

    def _load_engine(self):
        # Imported here: they pull in numpy and libcolibri.
        from colibrid.engine.engine import Engine
        from colibrid.engine.experts.cache import ExpertCacheError
        from colibrid.pack import Pack
        from colibrid.pack.manifest import PackError

        c = self.config
        try:
            pack = Pack.open(c.model)
            engine = Engine(pack, max_context=c.max_context, cache=self._cache_settings(),
                            parse_special_tokens_in_content=c.parse_special_tokens_in_content,
                            lookahead_predictor=c.lookahead_predictor, kv_cache_type=c.kv_cache_type)
        except PackError as exc:  # its message already names the pack and the fix
            raise StartupError(f"cannot load the model: {exc}") from None
        except ExpertCacheError as exc:  # its message says how to fix the machine
            raise StartupError(f"cannot set up the expert cache: {exc}") from None
        except Exception as exc:  # anything else is unexpected: one line here, the details at debug level
            log.debug("loading %s failed", self.config.model, exc_info=True)
            raise StartupError(f"cannot load the model {self.config.model}: {type(exc).__name__}: {exc}") from None
        if engine.max_context < self.config.max_context:
            # A warning when someone asked for more; the default meeting a small model is routine.
            chosen = self.config.max_context != DaemonConfig.__dataclass_fields__["max_context"].default
            log.log(logging.WARNING if chosen else logging.INFO,
                    "max_context = %d is above what %s supports; using %d tokens",
                    self.config.max_context, model_name(self.config.model), engine.max_context)
        return engine

    def _log_cache(self, engine, what: str) -> None:
        """After a rebuild: what the new cache is (the engine's log is quieter than the daemon's)."""
        log.info("expert cache %s: %d slots (cache_size = %s)", what, engine.cache_status()["slots"],
                 self.config.cache_size)
        self._log_budget(engine)

    @staticmethod
    def _log_budget(engine) -> None:
        """Which memory cache_size was measured against: MemAvailable or the cgroup limit."""
        budget = engine.memory_budget()
        log.info("expert cache %s: cache_size = %s of the memory budget %s (%s)", format_bytes(budget["cache_bytes"]),
                 budget["cache_size"], format_bytes(budget["available_bytes"]), budget["basis"])

    def _free_engine_after_failed_start(self) -> None:
        """Startup failed after the model was loaded (the socket, the thermal watch, the self-check):
        free the expert cache, which gives back the hugepages raised for it."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        if self._engine_loop is not None:
            self._engine_loop.stop()
            if not self._engine_loop.join(5.0):
                engine.return_hugepages()  # the slab stays mapped for the engine thread
                return
        engine.close()

    async def _check_socket_answers(self) -> None:
        """Say hello to ourselves on every socket: READY=1 promises that a client is answered now."""
        for listener in self._listeners:
            address = "\0" + listener.address[1:] if listener.address.startswith("@") else listener.address
            try:
                reply = await asyncio.wait_for(self._hello(address), SELF_CHECK_TIMEOUT_S)
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ProtocolViolation) as exc:
                raise StartupError(f"the socket {listener.address} does not answer: {exc!r}") from None
            if not isinstance(reply, HelloEvent):
                raise StartupError(f"the socket {listener.address} answered {reply.to_wire()!r} to hello")

    @staticmethod
    async def _hello(address: str) -> Event:
        reader, writer = await asyncio.open_unix_connection(address)
        try:
            writer.write(encode_frame(Hello(0, PROTOCOL_VERSION, "self-check").to_wire()))
            length = event_body_length(await reader.readexactly(LENGTH_PREFIX.size))
            return event_from_wire(decode_event_body(await reader.readexactly(length)))
        finally:
            writer.close()

    # -- main loop ------------------------------------------------------------------------

    async def main_loop(self) -> None:
        stop = asyncio.create_task(self._stop_requested.wait())
        try:
            while not self._stop_requested.is_set():
                reload = asyncio.create_task(self._reload_requested.wait())
                await asyncio.wait([stop, reload], return_when=asyncio.FIRST_COMPLETED)
                reload.cancel()
                if self._reload_requested.is_set() and not self._stop_requested.is_set():
                    self._reload_requested.clear()
                    self.reload()
        finally:
            stop.cancel()
        log.info("stopping: refusing new requests, finishing accepted ones")

    def reload(self) -> None:
        """SIGHUP: read the config again and apply what can change without reloading the model."""
        self._notifier.reloading()
        log.info("reloading the configuration")
        try:
            new = load_config(self._argv)
        except ConfigError as exc:
            log.error("reload failed, keeping the running configuration: %s", exc)
        else:
            self.apply_reload(new)
        self._notifier.ready(self._server.service_status(0.0) if self._server else None)

    def apply_reload(self, new: DaemonConfig) -> None:
        changes: dict[str, object] = {}
        for key in KEYS:
            old_value, new_value = getattr(self.config, key.name), getattr(new, key.name)
            if old_value == new_value:
                continue
            if key.reloadable:
                changes[key.name] = new_value
                log.info("%s: %s -> %s", key.name, old_value, new_value)
            else:
                log.warning("%s changed to %s; it takes effect at the next restart", key.name, new_value)
        self.config = dataclasses.replace(self.config, **changes)
        set_level(self.config.log_level)
        assert self._server is not None and self._engine_loop is not None and self._engine is not None
        self._engine_loop.max_queue = self.config.max_queue
        engine = self._engine
        if "cache_size" in changes:
            # The new pool is built with every new cache setting, on the engine thread between
            # steps (the engine swaps it in and closes the old one there).
            cache = self._cache_settings()

            def resize() -> None:
                if engine.rebuild_cache(cache):
                    self._log_cache(engine, "resized")

            self._engine_loop.run_between_steps(resize)
        else:
            engine.set_cache_policy(self.config.cache_policy)
        if self._thermal is not None:
            # io_queue_depth and prefetch go through the watch: a reload must not lift a throttle.
            self._thermal.update_settings(self._thermal_settings())
        self._server.reconfigure(ServerSettings.from_config(self.config), self._shown_settings())
        if self._watchdog is not None:
            self._watchdog.stall_timeout_s = self.config.stall_timeout_s

    def _shown_settings(self) -> dict:
        """The settings that reload can change and status does not show otherwise."""
        return {
            "log_level": self.config.log_level, "shutdown_grace_s": self.config.shutdown_grace_s,
            "stall_timeout_s": self.config.stall_timeout_s, "max_frame_bytes": self.config.max_frame_bytes,
            "default_max_tokens": self.config.default_max_tokens,
            "allow_users": list(self.config.allow_users), "allow_groups": list(self.config.allow_groups),
            **dataclasses.asdict(ClientLimits.from_config(self.config)),
        }

    async def _report_status(self) -> None:
        assert self._server is not None
        while True:
            await asyncio.sleep(STATUS_INTERVAL_S)
            self._notifier.status(self._server.service_status(self._server.sample_token_rate()))

    # -- shutdown -------------------------------------------------------------------------

    async def shutdown(self) -> None:
        self._notifier.stopping(f"stopping: finishing accepted requests (up to {self.config.shutdown_grace_s:g} s)")
        if self._server is not None:
            await self._server.drain(self.config.shutdown_grace_s, self._stop_now)
            await self._server.stop()
            self._close_expert_cache()
        self._close_listeners()
        self._cancel_background()
        log.info("stopped")

    def _close_expert_cache(self) -> None:
        """Free the cache and give back the hugetlb pages we added to vm.nr_hugepages — but
        only once the engine thread is gone: it may still be reading from the slots."""
        assert self._engine is not None and self._engine_loop is not None
        if self._engine_loop.finished:
            self._engine.close()
        else:
            log.warning("the engine thread is still running; leaving the expert cache to the kernel")
            self._engine.return_hugepages()  # freed by the kernel when the slab is unmapped at exit

    def _close_listeners(self) -> None:
        for listener in self._listeners:
            listener.close()
        self._listeners = []

    def _cancel_background(self) -> None:
        for task in self._background:
            task.cancel()
        self._background = []


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    configure_logging("info")  # until the config says otherwise, so config errors are seen
    try:
        config = load_config(argv)
    except ConfigError as exc:
        log.error("config error: %s", exc)
        return EXIT_CONFIG_ERROR
    configure_logging(config.log_level)
    return asyncio.run(Daemon(config, argv).serve())


if __name__ == "__main__":
    sys.exit(main())
