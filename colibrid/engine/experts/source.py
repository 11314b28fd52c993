"""The one narrow door to routed expert weights: an ExpertSource.

Model code asks for a layer step's experts and receives their three projections; where the
bytes come from - a plain read (PreadExpertSource, here) or the AEPC slab cache
(CachedExpertSource, cache.py) - is the source's business only. Every record is
checked against its CRC-32C before use.

ExpertSource declares every member its callers use - the MoE block (acquire, prefetch,
max_pinned, prefetch_enabled, holds_every_expert), the engine (summary, close) and the
thermal watch (the loader's queue depth, prefetch and loading pause) - so no caller probes a
source for what it can do. A source without a capability implements it trivially and says so (PlainExpertSource).
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import ContextManager

import numpy as np

from colibrid import native
from colibrid.thermal.loading_limits import LoadingLimits, LoadingPause  # part of this contract
from colibrid.pack.reader import ExpertWeights, Pack

log = logging.getLogger(__name__)


class ExpertLoadError(Exception):
    """An expert record could not be loaded; names the layer, the expert and where it lives."""

    def __init__(self, message: str, layer: int, expert: int, offset: int, path: Path) -> None:
        super().__init__(message)
        self.layer, self.expert, self.offset, self.path = layer, expert, offset, path


class ExpertChecksumError(ExpertLoadError):
    """An expert record's bytes do not match the CRC-32C in the manifest."""


class ExpertDamagedError(ExpertChecksumError):
    """A request needed an expert record known to be damaged (colibrid/pack/damage.py): it
    fails at once, without reading the record again. ``record`` is the mark, ``pack`` the
    open Pack it belongs to."""

    def __init__(self, record, pack: Pack) -> None:
        super().__init__(record.describe(pack), record.layer, record.expert, record.offset, pack.experts_path)
        self.record = record


def damaged_record_of(error: ExpertChecksumError, length: int, crc32c: int | None = None):
    """The damage mark of a record a load found damaged."""
    from colibrid.pack.damage import DamagedRecord

    return DamagedRecord(error.layer, error.expert, error.offset, length, "load", crc32c)


class ExpertLoadingPaused(ExpertLoadError):
    """A request needed an expert that is not in memory while loading is paused; ``code``
    is the protocol error code for it."""

    def __init__(self, message: str, code: str, layer: int, expert: int, offset: int, path) -> None:
        super().__init__(message, layer, expert, offset, path)
        self.code = code


class AcquiredExperts(Mapping[int, ExpertWeights]):
    """{expert: weights} of one ``acquire``, valid until its block exits. Looking an expert up
    may wait for its read; ``is_ready`` says, without waiting, whether it would."""

    @abstractmethod
    def is_ready(self, expert: int) -> bool: ...


class ExpertSource(ABC):
    """Where routed expert weights come from.

    ``acquire`` is what the model uses for a layer step: every expert it names is loaded (or
    found) and stays valid - never evicted or reused - until the context exits. ``get`` is a
    one-off convenience for tools and tests. ``max_pinned`` is how many experts one
    ``acquire`` may name (a cache's slot count); callers with more split the work into waves.
    ``prefetch`` starts reads of experts a later step will likely need, when
    ``prefetch_enabled`` and until the source ``holds_every_expert``. ``summary`` gives the
    counters status shows (kind, hits, misses, bytes_read, and what the cache is made of).

    The loader's settings (``io_queue_depth``, prefetch, ``loading_pause``) change at run time,
    from any thread: the thermal watch lowers them on a hot drive (apply_loading_limits).
    ``close`` frees everything; ``return_hugepages`` gives back only the hugetlb pages raised
    for the source, safe while another thread may still read from it.
    """

    @property
    @abstractmethod
    def max_pinned(self) -> int: ...

    @property
    @abstractmethod
    def prefetch_enabled(self) -> bool: ...

    @property
    @abstractmethod
    def io_queue_depth(self) -> int: ...

    @property
    @abstractmethod
    def loading_pause(self) -> LoadingPause | None: ...

    @abstractmethod
    def acquire(self, layer: int, experts: Sequence[int]) -> ContextManager[AcquiredExperts]: ...

    @abstractmethod
    def get(self, layer: int, expert: int) -> ExpertWeights: ...

    @abstractmethod
    def prefetch(self, layer: int, experts: Sequence[int]) -> int:
        """Start reads of ``experts`` of ``layer`` without waiting; returns reads started."""

    @property
    def holds_every_expert(self) -> bool:
        """Whether every expert of the pack is in memory (or on its way) for good, so that no read
        will start again: a lookahead then has nothing to fetch and makes no guesses. False
        unless a source knows better."""
        return False

    @abstractmethod
    def summary(self) -> dict: ...

    def hits_and_misses(self) -> tuple[int, int]:
        """The hit and miss counters of ``summary``, which a batch reads around every step: a
        source whose summary costs more than a few microseconds says so by overriding this."""
        summary = self.summary()
        return summary["hits"], summary["misses"]

    def layer_counters(self) -> dict[int, tuple[int, int]] | None:
        """Hits and misses since start per MoE layer, for the routing stream; None when the
        source keeps no per-layer counters (a plain pread source)."""
        return None

    @abstractmethod
    def set_io_queue_depth(self, depth: int) -> None: ...

    @abstractmethod
    def set_prefetch(self, enabled: bool) -> None: ...

    @abstractmethod
    def set_loading_paused(self, pause: LoadingPause | None) -> None: ...

    @abstractmethod
    def return_hugepages(self) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


def apply_loading_limits(source: ExpertSource, limits: LoadingLimits) -> None:
    """Make ``source`` read as ``limits`` say, touching only what differs (each setter logs)."""
    if source.io_queue_depth != limits.io_queue_depth:
        source.set_io_queue_depth(limits.io_queue_depth)
    if source.prefetch_enabled != limits.prefetch:
        source.set_prefetch(limits.prefetch)
    current = source.loading_pause
    if (current and current.code) != (limits.pause and limits.pause.code):
        source.set_loading_paused(limits.pause)


class LoadedExperts(AcquiredExperts):
    """An acquire's experts that are all in memory already: nothing to wait for."""

    def __init__(self, weights: dict[int, ExpertWeights]) -> None:
        self._weights = weights

    def __getitem__(self, expert: int) -> ExpertWeights:
        return self._weights[expert]

    def __iter__(self) -> Iterator[int]:
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)

    def is_ready(self, expert: int) -> bool:
        return True


class PlainExpertSource(ExpertSource):
    """A source without a slab cache, a loader queue or prefetch: what ``get`` returns is its own
    bytes, so nothing is pinned and any number of experts may be acquired at once. Subclasses
    implement ``get``; the capabilities they lack are trivial here."""

    def __init__(self, pack: Pack) -> None:
        self.pack = pack
        self._loading_pause: LoadingPause | None = None

    @property
    def max_pinned(self) -> int:
        return self.pack.manifest.model.num_experts  # nothing is pinned: a whole layer at once

    @property
    def prefetch_enabled(self) -> bool:
        return False  # reads happen when asked, never ahead

    @property
    def io_queue_depth(self) -> int:
        return 1  # get() reads one record at a time, on the caller's thread

    @property
    def loading_pause(self) -> LoadingPause | None:
        return self._loading_pause

    @contextmanager
    def acquire(self, layer: int, experts: Sequence[int]) -> Iterator[AcquiredExperts]:
        # Each record is its own bytes: nothing to pin or release.
        yield LoadedExperts({int(expert): self.get(layer, int(expert)) for expert in experts})

    def prefetch(self, layer: int, experts: Sequence[int]) -> int:
        """Never reads ahead: 0 reads started."""
        return 0

    def set_io_queue_depth(self, depth: int) -> None:
        """A no-op: reads are one synchronous read each, there is no queue to shorten."""

    def set_prefetch(self, enabled: bool) -> None:
        """A no-op: this source has no prefetch to turn on or off."""

    def set_loading_paused(self, pause: LoadingPause | None) -> None:
        """Remembered; a subclass that reads the drive refuses reads while paused."""
        self._loading_pause = pause

    def return_hugepages(self) -> None:
        """A no-op: no hugepages were raised for this source."""

    def close(self) -> None:
        """Nothing to free here; subclasses that hold a file close it."""


@dataclass
class ExpertReadStats:
    loads: int = 0
    bytes_read: int = 0


class PreadExpertSource(PlainExpertSource):
    """Reads a whole expert record with one pread and verifies its checksum. While loading is
    paused (the drive is hot or gone) every read is refused: nothing here is cached."""

    def __init__(self, pack: Pack) -> None:
        super().__init__(pack)
        self.stats = ExpertReadStats()
        self._fd = pack.experts.open()  # experts.bin, or the device carrying the pack's superblock
        self.path = pack.experts_path

    def get(self, layer: int, expert: int) -> ExpertWeights:
        record = self.pack.expert_record(layer, expert)
        damaged = self.pack.damage.get(layer, expert)
        if damaged is not None:
            raise ExpertDamagedError(damaged, self.pack)
        where = f"expert {expert} of layer {layer} at {self.pack.experts.where(record.offset)}"
        pause = self.loading_pause
        if pause is not None:
            raise ExpertLoadingPaused(f"{where} would be read while expert loading is paused: {pause.reason}",
                                      pause.code, layer, expert, record.offset, self.path)
        try:
            data = os.pread(self._fd, record.length, self.pack.experts.device_offset(record))
        except OSError as exc:
            raise ExpertLoadError(f"I/O error reading {where}: {exc.strerror}", layer, expert, record.offset, self.path) from None
        if len(data) != record.length:
            raise ExpertLoadError(f"short read ({len(data)} of {record.length} bytes) for {where}", layer, expert, record.offset, self.path)
        raw = np.frombuffer(data, dtype=np.uint8)
        crc = native.crc32c(raw)
        if crc != record.crc32c:
            error = ExpertChecksumError(
                f"checksum mismatch for {where}: crc32c {crc:#010x}, manifest {record.crc32c:#010x}",
                layer, expert, record.offset, self.path,
            )
            self.pack.damage.mark(damaged_record_of(error, record.length, crc))
            raise error
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
