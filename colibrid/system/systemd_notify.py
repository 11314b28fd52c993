"""Telling the service manager how the daemon is doing: sd_notify(3) through the sdnotify package.

systemd passes NOTIFY_SOCKET (a datagram socket) to a Type=notify service and reads lines like
READY=1, STATUS=..., WATCHDOG=1 from it. Without NOTIFY_SOCKET (a terminal, a test, another
init) every call here does nothing, so the daemon calls them unconditionally and has no
"am I under systemd" branches of its own.

The watchdog interval comes from WATCHDOG_USEC, which applies to us only if WATCHDOG_PID is
unset or is our pid (sd_watchdog_enabled(3)); pings go out at half of it, as systemd advises,
so one late ping is not yet a restart.
"""

from __future__ import annotations

import logging
import os
import time

import sdnotify

log = logging.getLogger(__name__)


def watchdog_interval_s() -> float | None:
    """Seconds between WATCHDOG=1 pings, or None if systemd runs no watchdog for this process."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None
    return int(usec) / 1e6 / 2


def _monotonic_usec() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


class Notifier:
    def __init__(self) -> None:
        self._notifier: sdnotify.SystemdNotifier | None = None
        self._last_status: str | None = None
        if os.environ.get("NOTIFY_SOCKET"):
            # debug=True: sdnotify then raises instead of swallowing, so a broken socket is logged once.
            try:
                self._notifier = sdnotify.SystemdNotifier(debug=True)
            except OSError as exc:
                log.warning("cannot open NOTIFY_SOCKET %s: %s; systemd will not hear from colibrid",
                            os.environ["NOTIFY_SOCKET"], exc.strerror)

    @property
    def enabled(self) -> bool:
        return self._notifier is not None

    def _send(self, *lines: str) -> None:
        if self._notifier is None or not lines:
            return
        try:
            self._notifier.notify("\n".join(lines))
        except OSError as exc:
            log.debug("sd_notify %r failed: %s", lines, exc)

    def ready(self, status: str | None = None) -> None:
        self._send("READY=1", *self._status_lines(status))

    def reloading(self, status: str = "reloading the configuration") -> None:
        # MONOTONIC_USEC tells a newer systemd (253+, Type=notify-reload) which reload this is;
        # systemd 252 ignores it.
        self._send("RELOADING=1", f"MONOTONIC_USEC={_monotonic_usec()}", *self._status_lines(status))

    def stopping(self, status: str = "stopping") -> None:
        self._send("STOPPING=1", *self._status_lines(status))

    def status(self, status: str) -> None:
        """STATUS=..., sent only when it differs from the last one: `systemctl status` shows the latest."""
        self._send(*self._status_lines(status))

    def watchdog(self) -> None:
        self._send("WATCHDOG=1")

    def _status_lines(self, status: str | None) -> list[str]:
        if status is None or status == self._last_status:
            return []
        self._last_status = status
        return [f"STATUS={status}"]
