"""A one-line progress bar on a terminal (silent when stderr is not a tty): parameters done,
the rate in parameters per second and the time left at that rate."""

from __future__ import annotations

import sys
import time

REDRAW_EVERY_S = 0.1


def format_duration(seconds: float) -> str:
    """'42s', '3m05s', '2h07m': a conversion of a 671 B model takes hours."""
    seconds = max(int(round(seconds)), 0)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    def __init__(self, total_params: int, label: str, stream=None, enabled: bool | None = None, clock=time.monotonic) -> None:
        self.total_params = max(total_params, 1)
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.done_params = 0
        self.clock = clock
        self.started = clock()
        self._last_draw = float("-inf")

    def elapsed_s(self) -> float:
        return self.clock() - self.started

    def rate_params_per_s(self) -> float:
        return self.done_params / max(self.elapsed_s(), 1e-6)

    def eta_s(self) -> float | None:
        """Seconds left at the rate so far; None before anything is done."""
        rate = self.rate_params_per_s()
        return (self.total_params - self.done_params) / rate if rate > 0 else None

    def advance(self, n_params: int, what: str = "") -> None:
        self.done_params += n_params
        now = self.clock()
        if self.enabled and (now - self._last_draw >= REDRAW_EVERY_S or self.done_params >= self.total_params):
            self._last_draw = now
            self.stream.write(self.line(what))
            self.stream.flush()

    def line(self, what: str = "") -> str:
        fraction = min(self.done_params / self.total_params, 1.0)
        width = 30
        bar = "#" * int(fraction * width) + "." * (width - int(fraction * width))
        eta = self.eta_s()
        return (
            f"\r{self.label} [{bar}] {fraction * 100:5.1f}% "
            f"{self.done_params / 1e9:.2f}/{self.total_params / 1e9:.2f} B params "
            f"{self.rate_params_per_s() / 1e6:6.1f} M params/s "
            f"ETA {format_duration(eta) if eta is not None else '?':>6} {what[:40]:<40}"
        )

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
