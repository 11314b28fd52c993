"""The one narrow door to routed expert weights: ``source.get(layer, expert)``.

Model code asks for an expert and receives its three projections; where the bytes come
from — a plain read now, the AEPC slab cache later — is this module's business only.
Every record is checked against its CRC-32C before use.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from contextlib import contextmanager
from typing import ContextManager, Iterator, Protocol, Sequence

import numpy as np

from colibrid import native
from colibrid.pack.reader import ExpertWeights, Pack

log = logging.getLogger(__name__)


class ExpertLoadError(Exception):
    """An expert record could not be loaded; names the layer, the expert and where it lives."""

    def __init__(self, message: str, layer: int, expert: int, offset: int, path: Path) -> None:
        super().__init__(message)
        self.layer, self.expert, self.offset, self.path = layer, expert, offset, path


class ExpertChecksumError(ExpertLoadError):
    """An expert record's bytes do not match the CRC-32C in the manifest."""


class ExpertSource(Protocol):
    """Where expert weights come from.

    ``acquire`` is what the model uses for a layer step: every expert it names is
    loaded (or found) and stays valid — never evicted or reused — until the context
    exits. ``get`` is a one-off convenience for tools and tests. ``max_pinned`` is
    how many experts one ``acquire`` may name (a cache's slot count); callers with
    more split the work into waves. ``summary`` gives the counters status shows
    (hits, misses, bytes_read, and what the cache is made of).
    """

    max_pinned: int

    def acquire(self, layer: int, experts: Sequence[int]) -> ContextManager[dict[int, ExpertWeights]]: ...

    def get(self, layer: int, expert: int) -> ExpertWeights: ...

    def summary(self) -> dict: ...


@dataclass
class ExpertReadStats:
    loads: int = 0
    bytes_read: int = 0


class PreadExpertSource:
    """Reads a whole expert record with one pread and verifies its checksum."""

    def __init__(self, pack: Pack) -> None:
        self.pack = pack
        self.path = pack.experts_path
        self.stats = ExpertReadStats()
        self.max_pinned = pack.manifest.model.num_experts  # nothing is pinned: any number at once
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))

    @contextmanager
    def acquire(self, layer: int, experts: Sequence[int]) -> Iterator[dict[int, ExpertWeights]]:
        # Each record is its own bytes object: nothing to pin or release.
        yield {expert: self.get(layer, expert) for expert in experts}

    def get(self, layer: int, expert: int) -> ExpertWeights:
        record = self.pack.expert_record(layer, expert)
        where = f"expert {expert} of layer {layer} at offset {record.offset} of {self.path}"
        try:
            data = os.pread(self._fd, record.length, record.offset)
        except OSError as exc:
            raise ExpertLoadError(f"I/O error reading {where}: {exc.strerror}", layer, expert, record.offset, self.path) from None
        if len(data) != record.length:
            raise ExpertLoadError(f"short read ({len(data)} of {record.length} bytes) for {where}", layer, expert, record.offset, self.path)
        raw = np.frombuffer(data, dtype=np.uint8)
        crc = native.crc32c(raw)
        if crc != record.crc32c:
            raise ExpertChecksumError(
                f"checksum mismatch for {where}: crc32c {crc:#010x}, manifest {record.crc32c:#010x}",
                layer, expert, record.offset, self.path,
            )
        self.stats.loads += 1
        self.stats.bytes_read += record.length
        return self.pack.expert_weights(raw)

    def summary(self) -> dict:
        """Counters for status and usage: without a cache every load is a miss."""
        return {"kind": "pread", "hits": 0, "misses": self.stats.loads, "bytes_read": self.stats.bytes_read}

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
