"""A stand-in for systemd's end of NOTIFY_SOCKET: a real datagram socket that records what arrives.

Each datagram is split into its lines (sd_notify(3) allows several assignments per message)
and kept with its arrival time, so tests can ask "did READY=1 come?" and "how often did
WATCHDOG=1 come?".
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path


class NotifySocket:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(path))
        self._sock.settimeout(0.1)
        self._lock = threading.Lock()
        self.messages: list[tuple[float, list[str]]] = []  # (monotonic time, lines of one datagram)
        self._closed = False
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._closed:
            try:
                data = self._sock.recv(4096)
            except socket.timeout:
                continue
            except OSError:
                return
            with self._lock:
                self.messages.append((time.monotonic(), data.decode().split("\n")))

    def close(self) -> None:
        self._closed = True
        self._thread.join()
        self._sock.close()

    def lines(self) -> list[str]:
        with self._lock:
            return [line for _, lines in self.messages for line in lines]

    def times_of(self, line: str) -> list[float]:
        with self._lock:
            return [at for at, lines in self.messages if line in lines]

    def wait_for(self, line: str, timeout_s: float = 30.0, after: int = 0) -> int:
        """Until `line` arrives (as message number >= after); returns that message's number."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                for number, (_, lines) in enumerate(self.messages[after:], start=after):
                    if line in lines:
                        return number
            time.sleep(0.01)
        raise TimeoutError(f"{line!r} did not arrive within {timeout_s} s; got {self.lines()}")
