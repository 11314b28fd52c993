"""colibrid: the daemon's lifecycle, in named phases.

    run()      config -> logging -> asyncio.run(serve())           exit code
    startup    load the engine, bind the socket, start the engine thread and the server
    main loop  wait until SIGTERM or SIGINT asks to stop
    shutdown   stop accepting, end open requests with `shutdown`, close connections,
               remove the socket

Signal handlers only set a flag (an asyncio.Event); everything else happens in the phases,
where it can be ordered and logged. Exit codes: 0 after a clean stop, 1 if startup failed
(the model or the socket), 2 for a configuration error.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from colibrid.config import ConfigError, DaemonConfig, load_config
from colibrid.listener import Listener, ListenerError, open_listener
from colibrid.scheduler import Scheduler
from colibrid.server import Server, model_name

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_STARTUP_FAILED = 1
EXIT_CONFIG_ERROR = 2


class StartupError(Exception):
    """The daemon cannot start; str() is the one line that says why."""


class _DaemonFormatter(logging.Formatter):
    """`colibrid: message`, the level only when it is not plain information: one line a user can read."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.levelno == logging.WARNING:
            message = "warning: " + message
        elif record.levelno == logging.DEBUG:
            message = f"debug: {record.name}: {message}"
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        return "colibrid: " + message


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_DaemonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # The engine logs its own "loaded ..." line; the daemon's startup line says the same and more.
    logging.getLogger("colibrid.engine").setLevel(logging.DEBUG if level == "debug" else logging.WARNING)


def _count(parameters: int) -> str:
    """6.92B, 14.7M: how model sizes are usually said."""
    return f"{parameters / 1e9:.2f}B" if parameters >= 1e9 else f"{parameters / 1e6:.1f}M"


class Daemon:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self._stop_requested = asyncio.Event()
        self._listener: Listener | None = None
        self._server: Server | None = None

    async def serve(self) -> int:
        # First of all, so that a SIGTERM during startup (loading a large model takes a while)
        # still leads through shutdown, which removes the socket, instead of killing us halfway.
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._stop_requested.set)
        try:
            await self.startup()
        except BaseException as exc:
            self._close_listener()  # a half-started daemon must not leave its socket behind
            if not isinstance(exc, StartupError):
                raise
            log.error("%s", exc)
            return EXIT_STARTUP_FAILED
        try:
            await self.main_loop()
        finally:
            await self.shutdown()
        return EXIT_OK

    async def startup(self) -> None:
        engine = self._load_engine()
        try:
            self._listener = open_listener(self.config.socket)
        except ListenerError as exc:
            raise StartupError(str(exc)) from None
        scheduler = Scheduler(engine, self.config.max_queue)
        scheduler.start()
        self._server = Server(engine, scheduler, self.config.model, self.config.max_frame_bytes,
                              self.config.default_max_tokens)
        await self._server.start(self._listener)
        log.info("serving %s (%s params, %s active) from %s on %s \u2014 stop with Ctrl-C or SIGTERM",
                 model_name(self.config.model), _count(engine.parameters_total),
                 _count(engine.parameters_active), self.config.model, self.config.socket)

    def _load_engine(self):
        from colibrid.engine import load  # imported here: it pulls in numpy and libcolibri
        from colibrid.pack.manifest import PackError

        try:
            engine = load(self.config.model, max_context=self.config.max_context)
        except PackError as exc:  # its message already names the pack and the fix
            raise StartupError(f"cannot load the model: {exc}") from None
        except Exception as exc:  # anything else is unexpected: one line here, the details at debug level
            log.debug("loading %s failed", self.config.model, exc_info=True)
            raise StartupError(f"cannot load the model {self.config.model}: {type(exc).__name__}: {exc}") from None
        if engine.max_context < self.config.max_context:
            log.warning("max_context = %d is above what %s supports; using %d tokens",
                        self.config.max_context, model_name(self.config.model), engine.max_context)
        return engine

    async def main_loop(self) -> None:
        await self._stop_requested.wait()
        log.info("stopping: ending open requests and closing connections")

    async def shutdown(self) -> None:
        if self._server is not None:
            await self._server.stop()
        self._close_listener()
        log.info("stopped")

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None


def main(argv: Sequence[str] | None = None) -> int:
    configure_logging("info")  # until the config says otherwise, so config errors are seen
    try:
        config = load_config(argv)
    except ConfigError as exc:
        log.error("config error: %s", exc)
        return EXIT_CONFIG_ERROR
    configure_logging(config.log_level)
    return asyncio.run(Daemon(config).serve())


if __name__ == "__main__":
    sys.exit(main())
