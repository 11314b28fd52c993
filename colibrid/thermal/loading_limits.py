"""How an expert source may read right now - set by the thermal watch, applied by the engine.

Apart from experts.py so that the thermal watch can name them without loading libcolibri.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoadingPause:
    """Why expert loading is paused (set by the thermal watch): misses fail, hits still serve."""

    code: str  # the protocol error code a refused request gets: "thermal" or "device_missing"
    reason: str  # one line for people: "nvme0 at 84 °C (critical threshold 80 °C)"


@dataclass(frozen=True)
class LoadingLimits:
    """How an expert source may read now: reads in flight at most, whether prefetch reads,
    and why loading is paused (None: it is not)."""

    io_queue_depth: int
    prefetch: bool
    pause: LoadingPause | None = None
