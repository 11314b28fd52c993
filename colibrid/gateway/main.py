"""`colibri-openai`: start-up, serving and shutdown of the gateway.

The listening socket is systemd's when colibri-openai.socket passes one (socket activation:
LISTEN_PID is our pid, the sockets start at fd 3), else the `listen` address is bound here.
SIGTERM stops accepting and lets open requests finish for SHUTDOWN_GRACE_S.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from typing import Sequence

from aiohttp import web

from colibrid import __version__
from colibrid.gateway.app import Gateway
from colibrid.gateway.config import ConfigError, GatewayConfig, load_config, parse_listen
from colibrid.system.logsetup import configure_logging
from colibrid.system.systemd_notify import Notifier

log = logging.getLogger("colibrid.gateway")

SD_LISTEN_FDS_START = 3  # sd_listen_fds(3)
SHUTDOWN_GRACE_S = 30.0
EXIT_CONFIG = 2


def inherited_sockets() -> list[socket.socket]:
    """TCP listening sockets systemd passed to this very process (the LISTEN_* variables are consumed)."""
    listen_pid, listen_fds = os.environ.get("LISTEN_PID", ""), os.environ.get("LISTEN_FDS", "")
    if not (listen_pid.isdigit() and listen_fds.isdigit() and int(listen_pid) == os.getpid()):
        return []
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(name, None)
    sockets = []
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + int(listen_fds)):
        sock = socket.socket(fileno=fd)
        if sock.type != socket.SOCK_STREAM or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise ConfigError(f"inherited fd {fd} is not a listening stream socket; use ListenStream= in the .socket")
        os.set_inheritable(fd, False)
        sockets.append(sock)
    return sockets


def bind(listen: str) -> socket.socket:
    host, port = parse_listen(listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {listen}: {exc.strerror}") from None
    sock.listen(128)
    return sock


async def serve(config: GatewayConfig, sockets: list[socket.socket]) -> None:
    gateway = Gateway(config)
    # handler_cancellation: a client that disconnects cancels its handler, which cancels its ask.
    runner = web.AppRunner(gateway.application(), handler_cancellation=True, access_log=None,
                           shutdown_timeout=SHUTDOWN_GRACE_S)
    await runner.setup()
    for sock in sockets:
        await web.SockSite(runner, sock).start()
    addresses = ", ".join(_address(sock) for sock in sockets)
    log.info("colibri-openai %s serving on %s for colibrid at %s", __version__, addresses, config.socket)
    notifier = Notifier()
    notifier.ready(f"serving on {addresses}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    notifier.stopping()
    log.info("stopping: open requests may finish within %.0f s", SHUTDOWN_GRACE_S)
    await runner.cleanup()
    log.info("stopped")


def _address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = load_config(argv)
        configure_logging(config.log_level)
        Gateway(config)  # reads api_keys_file: a bad one stops us here, before binding
        sockets = inherited_sockets() or [bind(config.listen)]
    except ConfigError as exc:
        print(f"colibri-openai: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    asyncio.run(serve(config, sockets))
    return 0
