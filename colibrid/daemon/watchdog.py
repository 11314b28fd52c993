"""The systemd watchdog: WATCHDOG=1 at half of WATCHDOG_USEC, but only while the engine is healthy.

Pinging from a timer alone would only prove that the event loop runs; the failure worth a
restart is an engine that stopped producing tokens (a wedged disk read, a deadlock in native
code) while clients wait. So each tick asks the engine loop how long the running request has gone
without progress, and skips the ping while that exceeds stall_timeout_s. systemd then restarts
the service WatchdogSec= after the last ping (Restart=on-failure). An idle daemon is healthy.
"""

from __future__ import annotations

import asyncio
import logging

from colibrid.daemon.engine_loop import EngineLoop
from colibrid.system.systemd_notify import Notifier

log = logging.getLogger(__name__)


class Watchdog:
    def __init__(self, notifier: Notifier, interval_s: float, stall_timeout_s: float) -> None:
        self.notifier = notifier
        self.interval_s = interval_s
        self.stall_timeout_s = stall_timeout_s  # replaced on reload
        self.engine_loop: EngineLoop | None = None  # None while starting: loading the model is not a stall
        self._healthy = True

    async def run(self) -> None:
        while True:
            self.tick()
            await asyncio.sleep(self.interval_s)

    def tick(self) -> None:
        stalled_s = 0.0 if self.engine_loop is None else self.engine_loop.seconds_without_progress()
        healthy = stalled_s <= self.stall_timeout_s
        if healthy:
            self.notifier.watchdog()
        if healthy != self._healthy:
            if healthy:
                log.warning("the engine is making progress again; watchdog pings resumed")
            else:
                log.error("the engine has produced no token for %.1f s (stall_timeout_s = %g); "
                          "watchdog pings stopped, so systemd will restart colibrid", stalled_s, self.stall_timeout_s)
            self._healthy = healthy
