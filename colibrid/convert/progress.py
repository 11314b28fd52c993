"""A one-line progress bar on a terminal; silent when stderr is not a tty."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total_bytes: int, label: str, stream=None, enabled: bool | None = None) -> None:
        self.total_bytes = max(total_bytes, 1)
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.done_bytes = 0
        self.started = time.monotonic()
        self._last_draw = 0.0

    def advance(self, nbytes: int, what: str = "") -> None:
        self.done_bytes += nbytes
        now = time.monotonic()
        if self.enabled and (now - self._last_draw > 0.1 or self.done_bytes >= self.total_bytes):
            self._last_draw = now
            self._draw(now, what)

    def _draw(self, now: float, what: str) -> None:
        fraction = min(self.done_bytes / self.total_bytes, 1.0)
        width = 30
        bar = "#" * int(fraction * width) + "." * (width - int(fraction * width))
        elapsed = max(now - self.started, 1e-6)
        rate = self.done_bytes / elapsed
        eta = (self.total_bytes - self.done_bytes) / rate if rate > 0 else 0.0
        line = (
            f"\r{self.label} [{bar}] {fraction * 100:5.1f}% "
            f"{self.done_bytes / 1e9:.2f}/{self.total_bytes / 1e9:.2f} GB {rate / 1e6:6.0f} MB/s "
            f"ETA {eta:4.0f}s {what[:40]:<40}"
        )
        self.stream.write(line)
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
