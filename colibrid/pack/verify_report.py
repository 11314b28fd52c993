"""What a pack verify (pack/verify.py) reports and how its caller steers it: each Damage found,
the Progress, the final VerifyReport, and the VerifyControls (callbacks, a bandwidth cap, a
stop). ``colibri-verify`` and the daemon's `verify` request turn these into their output."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from colibrid.pack.manifest import ExpertRecord


class VerifyCancelled(Exception):
    """The verify was stopped before its end (a cancel, a disconnect, a shutdown)."""


@dataclass(frozen=True)
class Damage:
    """One thing found wrong: ``file`` of the pack, and where in it when that is known."""

    file: str
    message: str  # one line for humans, naming the place again
    offset: int | None = None  # bytes into the file
    length: int | None = None  # bytes from offset
    layer: int | None = None  # an expert record's
    expert: int | None = None
    tensor: str | None = None  # a dense tensor's name

    def to_json(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value is not None}


@dataclass(frozen=True)
class Progress:
    bytes_done: int
    bytes_total: int
    elapsed_s: float  # since the start, pauses included
    file: str  # the file being read

    @property
    def mb_per_s(self) -> float:
        return self.bytes_done / 1e6 / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the rate so far; None before anything is done."""
        rate = self.bytes_done / self.elapsed_s if self.elapsed_s > 0 else 0.0
        return (self.bytes_total - self.bytes_done) / rate if rate > 0 else None

    def to_json(self) -> dict[str, Any]:
        return {"bytes_done": self.bytes_done, "bytes_total": self.bytes_total, "elapsed_s": round(self.elapsed_s, 3),
                "mb_per_s": round(self.mb_per_s, 1), "eta_s": None if self.eta_s is None else round(self.eta_s, 1),
                "file": self.file}


@dataclass
class VerifyReport:
    pack: str
    damage: list[Damage] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what this verify could not check, and why
    files: dict[str, str] = field(default_factory=dict)  # file -> "ok", "damaged", "sha256 not recorded", ...
    bytes_read: int = 0
    seconds: float = 0.0
    cancelled: bool = False

    @property
    def clean(self) -> bool:
        return not self.damage and not self.cancelled

    def to_json(self, max_damage: int | None = None) -> dict[str, Any]:
        """The report; ``max_damage``: list at most that many findings (damage_found counts all)."""
        return {"pack": self.pack, "clean": self.clean, "cancelled": self.cancelled,
                "damage": [d.to_json() for d in self.damage[:max_damage]], "damage_found": len(self.damage),
                "notes": list(self.notes), "files": dict(self.files), "bytes_read": self.bytes_read,
                "seconds": round(self.seconds, 3)}


@dataclass
class VerifyControls:
    """How a verify reports and yields. Every callback may be called from either of the
    verify's two threads; ``before_read`` runs on the reading thread before each read and may
    block (the daemon waits there while it serves); ``stop`` set means stop at the next read."""

    on_progress: Callable[[Progress], None] | None = None
    on_damage: Callable[[Damage], None] | None = None
    # each record checked: (record, intact, the CRC-32C read when it does not match its checksum)
    on_expert: Callable[[ExpertRecord, bool, int | None], None] | None = None
    before_read: Callable[[], None] | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    max_bytes_per_s: float | None = None  # a bandwidth cap; None: as fast as the disk goes
    progress_interval_s: float = 0.5
