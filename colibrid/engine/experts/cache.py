"""CachedExpertSource: routed experts served from the AEPC slab cache in libcolibri.

The ExpertSource protocol (colibrid.engine.experts.source) over three C objects:
  slab    one region of S slots (one padded expert record each), hugetlb/THP-backed and
          mlock'ed as configured;
  loader  I/O threads reading records with O_DIRECT, at most io_queue_depth in flight,
          every record's CRC-32C checked;
  cache   (layer, expert) -> slot, reference-counted pins, LRU or LFRU eviction, prefetch.

A layer step does ``with source.acquire(layer, experts) as weights:`` — one C call pins the
experts and starts the reads of the misses, ``weights[e]`` waits for expert e only (GIL
released), one call unpins at the end. The weights are read-only numpy views into the slab: valid inside the ``with`` only.

Same model, any placement: the bytes a view shows are exactly the record's bytes (checked),
so outputs are bit-identical to PreadExpertSource for every cache size.

What backs the slab (its size, hugetlb pages, the lock, every fallback) is slab.py, asking the
machine through the CacheMemory handed in (backing.py); the counters status shows are
cache_stats.py.

Shape letters: S slots, L layers, E experts per layer, N experts in one request.
"""

from __future__ import annotations

import functools
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from collections.abc import Iterator, Sequence

import numpy as np

from colibrid import native
from colibrid.engine.experts.backing import CacheMemory, StatedMemory
from colibrid.engine.experts.cache_stats import PredictionTally, cache_stats
from colibrid.engine.experts.slab import (BACKING_NAMES, LOCK_MODES, ExpertCacheError, HugepagePlan, check_budget,
                                          count_slots, errno_name, expert_slot_bytes, map_slab, plan_hugepages)
from colibrid.engine.experts.source import (AcquiredExperts, ExpertChecksumError, ExpertDamagedError, ExpertLoadError,
                                     ExpertLoadingPaused, ExpertSource, LoadingPause, damaged_record_of)
from colibrid.sizes import format_bytes
from colibrid.pack.manifest import PackError
from colibrid.pack.reader import ExpertWeights, Pack

log = logging.getLogger(__name__)

POLICIES = {"lru": native.CachePolicy.LRU, "lfru": native.CachePolicy.LFRU, "lfu-decay": native.CachePolicy.DECAYED_LFU,
            "next-use": native.CachePolicy.NEXT_USE}
# lfu-decay's half-life, in decode tokens: the best of a sweep on both trained models' routing
# traces (docs/performance-log.md); the cache counts it in requested experts (layers x top-k a token).
DECAY_HALF_LIFE_TOKENS = 16


@dataclass(frozen=True)
class ExpertCacheSettings:
    """How the engine builds its expert cache: the daemon's config keys of the same names
    (cache_size, cache_policy, io_queue_depth, prefetch, hugepages, lock_memory), and what
    the machine gives it. See CachedExpertSource for what each value means."""

    cache_size: int | str = "50%"
    policy: str = "next-use"
    io_queue_depth: int = 16
    prefetch: bool = False
    hugepages: str | int = "auto"
    lock_memory: str = "try"
    # The machine's memory (budget, hugetlb pages, memlock hint); None: StatedMemory(), which
    # measures nothing and raises no hugetlb pages. The daemon hands in the system's.
    memory: CacheMemory | None = None
    # The CPUs of the cache's loader threads, which inherit the mask of the thread that makes
    # the cache (the engine's, on the compute CPUs); None: that thread's CPUs.
    loader_cpus: frozenset[int] | None = None


class _PinnedExperts(AcquiredExperts):
    """{expert: ExpertWeights} for one acquire; looking an expert up waits for that expert's
    read only, so the experts already cached are computed on while the misses still load."""

    def __init__(self, source: "CachedExpertSource", layer: int, ids: list[int], slots: list[int]) -> None:
        self._source, self._layer = source, layer
        self._slot = dict(zip(ids, slots))
        self._ready: dict[int, ExpertWeights] = {}

    def __getitem__(self, expert: int) -> ExpertWeights:
        weights = self._ready.get(expert)
        if weights is None:
            slot = self._slot[expert]  # KeyError for an expert that was not acquired
            weights = self._ready[expert] = self._source._wait_slot(self._layer, expert, slot)
        return weights

    def is_ready(self, expert: int) -> bool:
        """True if ``expert`` is loaded: looking it up will not wait (never blocks)."""
        if expert in self._ready:
            return True
        if not self._source._cache.contains(self._layer, expert):
            return False
        # loaded and checked, and pinned by this acquire: its slot's bytes stay as they are
        self._ready[expert] = self._source._slot_weights(self._slot[expert])
        return True

    def __iter__(self) -> Iterator[int]:
        return iter(self._slot)

    def __len__(self) -> int:
        return len(self._slot)


def decay_half_life_requests(config, table: np.ndarray) -> int:
    """DECAY_HALF_LIFE_TOKENS in the cache's clock: experts requested per decode token is the
    MoE layers (those with records) times top-k."""
    moe_layers = int((table["length"] > 0).any(axis=1).sum())
    return max(1, DECAY_HALF_LIFE_TOKENS * moe_layers * max(1, config.num_experts_per_tok))


class CachedExpertSource(ExpertSource):
    """An ExpertSource whose experts live in a bounded slab cache.

    cache_bytes      int or a size string ("6G", "40%" of the memory budget ``memory`` gives:
                     for the daemon MemAvailable, or the headroom under the cgroup memory
                     limit when smaller); rounded down to whole slots, at least one slot, at
                     most one slot per expert.
    policy           "next-use" (the expert whose next request is expected farthest ahead, from
                     its layer's place in the pass over the layers and its decayed per-token
                     rate, half-life 16 tokens), "lfu-decay" (frequency with exponential decay,
                     half-life DECAY_HALF_LIFE_TOKENS decode tokens, the least recent on ties),
                     "lfru" (per-layer quotas, least-frequently-used within a layer) or "lru".
    io_queue_depth   reads in flight at most (changeable: set_io_queue_depth).
    hugepages        "auto": hugetlb 2 MiB pages, raising vm.nr_hugepages when ``memory`` may
                     (and giving them back on close) and not under a cgroup memory limit
                     (which would not count them), else transparent hugepages, else pages;
                     "thp": transparent hugepages, else pages; "off": ordinary pages;
                     an int N: raise vm.nr_hugepages to at least N and require hugetlb pages.
    lock_memory      "required" (fail with a fix-it message), "try" (log and go on), "off".
    prefetch         whether prefetch() starts reads (changeable: set_prefetch).
    direct           "try" (O_DIRECT; buffered only if the file system refuses it),
                     "required", "off".
    memory           the machine's memory (a CacheMemory): the budget a percentage is of,
                     hugetlb pages, how to lift a memlock limit. None: StatedMemory(), no
                     budget and no hugetlb pages, nothing on the machine changed. The daemon
                     hands in colibrid.system.cache_memory.MachineMemory.

    set_loading_paused(LoadingPause) stops every read (the thermal watch does, at the drive's
    critical temperature or when the drive is gone): a step that needs a read raises
    ExpertLoadingPaused, a step served from the cache goes on.
    """

    def __init__(self, pack: Pack, cache_bytes: int | str, policy: str = "next-use", io_queue_depth: int = 16,
                 hugepages: str | int = "auto", lock_memory: str = "try", prefetch: bool = True,
                 direct: str = "try", max_io_queue_depth: int = 32, memory: CacheMemory | None = None) -> None:
        self.pack = pack
        self.path = pack.experts_path
        self.hugepages_mode = hugepages
        manifest = pack.manifest
        config = manifest.model
        if policy not in POLICIES:
            raise ExpertCacheError(f"policy {policy!r} is unknown; use one of {', '.join(POLICIES)}")
        if lock_memory not in LOCK_MODES:
            raise ExpertCacheError(f"lock_memory {lock_memory!r} is unknown; use \"required\", \"try\" or \"off\"")
        if direct not in LOCK_MODES:
            raise ExpertCacheError(f"direct {direct!r} is unknown; use \"required\", \"try\" or \"off\"")
        records = manifest.expert_records
        if not records:
            raise ExpertCacheError(f"pack {pack.path} has no routed experts: nothing to cache")
        self.slot_bytes = expert_slot_bytes(manifest)
        self.memory = memory if memory is not None else StatedMemory()
        self.budget = self.memory.budget()
        self.cache_size_setting = cache_bytes
        self.n_slots = count_slots(cache_bytes, self.slot_bytes, len(records), self.budget)
        self._n_records = len(records)
        self._holds_every_expert = False  # once every record is resident (it stays so: nothing is evicted)
        self.notes: list[str] = []  # every fallback taken, for status
        region_bytes = self.n_slots * self.slot_bytes
        check_budget(cache_bytes, region_bytes, self.budget, self.notes)

        # (L, E) index of records for C; length 0 marks dense layers and missing experts.
        table = np.zeros((config.num_layers, max(config.num_experts, 1)), dtype=native.EXPERT_RECORD_DTYPE)
        for r in records:
            table[r.layer, r.expert] = (r.offset, r.length, r.crc32c, 0)
        self._lengths = table["length"].copy()  # (L, E)
        self._offsets = table["offset"].copy()  # (L, E) bytes into the experts region, as the manifest has them
        # Where the loader reads: a region on a raw device starts after its superblock.
        table["offset"] += pack.experts.base_offset

        self._hugepages: HugepagePlan = plan_hugepages(hugepages, region_bytes, self.memory, self.budget, self.notes)
        self._slab = self._loader = self._cache = None
        try:
            self._slab = map_slab(self.slot_bytes, self.n_slots, self._hugepages, hugepages, lock_memory, self.memory,
                                  self.notes)
            self._loader = self._make_loader(io_queue_depth, max_io_queue_depth, direct)
            # Concurrent layer steps (several sessions) wait for each other's slots.
            self._cache = native.ExpertCacheCore(self._slab, self._loader, table, POLICIES[policy], wait_for_pins=True,
                                                 decay_half_life=decay_half_life_requests(config, table))
        except BaseException:
            self.close()
            raise
        self.policy = policy
        self._prefetch_enabled = bool(prefetch)
        self._loading_pause: LoadingPause | None = None
        self._slot_views: list[ExpertWeights | None] = [None] * self.n_slots  # _slot_weights
        self._region = self._slab.data.view()
        self._region.flags.writeable = False  # experts are read-only to the model
        self._predictions = PredictionTally(config.num_layers)
        self.lock_memory = lock_memory
        log.info("expert cache: %d slots of %s (%s), %s", self.n_slots, format_bytes(self.slot_bytes),
                 format_bytes(self.n_slots * self.slot_bytes), self._backing_summary())

    @classmethod
    def from_settings(cls, pack: Pack, settings: ExpertCacheSettings) -> "CachedExpertSource":
        """A cache built as ``settings`` say, its loader threads started on settings.loader_cpus."""
        build = functools.partial(cls, pack, settings.cache_size, policy=settings.policy,
                                  io_queue_depth=settings.io_queue_depth, hugepages=settings.hugepages,
                                  lock_memory=settings.lock_memory, prefetch=settings.prefetch,
                                  memory=settings.memory)
        if settings.loader_cpus is None:
            return build()
        cpus_before = os.sched_getaffinity(0)  # this thread's (Linux applies the mask per thread)
        os.sched_setaffinity(0, settings.loader_cpus)
        try:
            return build()
        finally:
            os.sched_setaffinity(0, cpus_before)

    # ---- setup -------------------------------------------------------------------------

    def _make_loader(self, depth: int, max_depth: int, direct: str) -> native.Loader:
        if not 1 <= depth <= max_depth:
            raise ExpertCacheError(f"io_queue_depth must be in 1..{max_depth}, got {depth}")
        try:
            loader = self.pack.experts.loader(depth, max_depth, LOCK_MODES[direct])
        except (native.ReadError, native.SystemResourceError) as exc:
            raise ExpertCacheError(f"experts file {self.path}: {exc}") from None
        except PackError as exc:  # the device carrying the experts region is gone
            raise ExpertCacheError(str(exc)) from None
        self.path = self.pack.experts_path  # a device may be back under another name
        info = loader.info()
        if direct != "off" and not info["direct"]:
            note = f"O_DIRECT refused by the file system of {self.path} (EINVAL): buffered reads"
            log.warning("%s", note)
            self.notes.append(note)
        return loader

    def _backing_summary(self) -> str:
        info = self.backing_info()
        return (f"backing {info['backing']}, {'locked' if info['locked'] else 'not locked'}, "
                f"{'O_DIRECT' if info['direct'] else 'buffered'} reads, queue depth {info['io_queue_depth']}")

    # ---- the ExpertSource protocol ------------------------------------------------------

    @property
    def max_pinned(self) -> int:
        return self.n_slots  # every slot may be pinned by one acquire

    @property
    def prefetch_enabled(self) -> bool:
        return self._prefetch_enabled

    @property
    def holds_every_expert(self) -> bool:
        """Every record resident or loading. Only a cache with a slot for each can get there, and
        then it never evicts, so the answer, once yes, stays yes."""
        if not self._holds_every_expert and self.n_slots >= self._n_records:
            self._holds_every_expert = self._cache.count()[0] >= self._n_records
        return self._holds_every_expert

    @property
    def io_queue_depth(self) -> int:
        """Reads in flight at most, as the C loader has it now."""
        return self._loader.info()["queue_depth"]

    @property
    def loading_pause(self) -> LoadingPause | None:
        return self._loading_pause

    @contextmanager
    def acquire(self, layer: int, experts: Sequence[int]) -> Iterator[AcquiredExperts]:
        """Pins ``experts`` of ``layer`` (at most max_pinned, distinct) and starts reading the
        misses; yields a mapping {expert: weights} valid until the block exits, whose lookup
        waits for that one expert (so cached experts compute while the misses load).
        A lookup raises ExpertChecksumError / ExpertLoadError naming the expert that failed."""
        ids = [int(e) for e in experts]
        self._predictions.note_requested(layer, ids)
        with self._pinned(layer, ids, wait=False) as slots:
            yield _PinnedExperts(self, layer, ids, slots)

    def get(self, layer: int, expert: int) -> ExpertWeights:
        """One expert, copied out of the cache (so it stays valid after the call)."""
        with self._pinned(layer, [int(expert)]) as slots:
            raw = self._record_view(layer, expert, slots[0]).copy()
        return self.pack.expert_weights(raw)

    @contextmanager
    def _pinned(self, layer: int, ids: list[int], wait: bool = True) -> Iterator[list[int]]:
        """Slots holding ``ids`` of ``layer``, pinned for the block; loaded when ``wait``
        (else the caller waits per slot: _wait_slot)."""
        if len(ids) > self.max_pinned:
            raise ValueError(f"acquire of {len(ids)} experts, the cache pins at most {self.max_pinned}: split into waves")
        self._refuse_damaged(layer, ids)
        self._refuse_misses_while_paused(layer, ids)
        slots = self._cache.acquire(layer, ids)  # (N,) int32
        try:
            if wait:
                status, results = self._cache.wait(slots)
                if status != 0:
                    i = next(i for i, r in enumerate(results) if r["status"] != 0)
                    raise self._load_error(layer, ids[i], results[i])
            yield [int(s) for s in slots]
        finally:
            self._cache.release(slots)

    def _refuse_damaged(self, layer: int, ids: list[int]) -> None:
        """A record marked damaged is not read again: the step fails at once, naming it."""
        damaged = self.pack.damage.in_layer(layer)
        for expert in ids if damaged else ():
            if expert in damaged:
                raise ExpertDamagedError(self.pack.damage.get(layer, expert), self.pack)

    def _refuse_misses_while_paused(self, layer: int, ids: list[int]) -> None:
        """While loading is paused, a step that would read any expert fails before it pins
        anything; a step whose experts are all cached goes on. (Another session could evict
        one between this check and the pin; that read then happens - one read, not a stream.)"""
        pause = self.loading_pause
        if pause is None:
            return
        missing = [e for e in ids if not self._cache.contains(layer, e)]
        if missing:
            expert = missing[0]
            raise ExpertLoadingPaused(
                f"expert {expert} of layer {layer} is not in the cache and expert loading is paused: {pause.reason}",
                pause.code, layer, expert, int(self._offsets[layer, expert]), self.path)

    def _wait_slot(self, layer: int, expert: int, slot: int) -> ExpertWeights:
        """Blocks (GIL released) until ``slot``, pinned for (layer, expert), is loaded."""
        status, results = self._cache.wait(np.array([slot], dtype=np.int32))
        if status != 0:
            raise self._load_error(layer, expert, results[0])
        return self._slot_weights(slot)

    def _record_view(self, layer: int, expert: int, slot: int) -> np.ndarray:
        start = slot * self.slot_bytes
        return self._region[start : start + int(self._lengths[layer, expert])]  # uint8 (record length,)

    def _slot_weights(self, slot: int) -> ExpertWeights:
        """The expert views of ``slot``: every record has the same parts layout, so a slot's
        views never change and are built once (with their kernel pointers), not per step."""
        weights = self._slot_views[slot]
        if weights is None:
            start = slot * self.slot_bytes
            weights = self._slot_views[slot] = self.pack.expert_weights(self._region[start : start + self.slot_bytes])
        return weights

    def _load_error(self, layer: int, expert: int, result: dict) -> ExpertLoadError:
        offset = int(self._offsets[layer, expert])
        where = f"expert {expert} of layer {layer} at {self.pack.experts.where(offset)}"
        if result["status"] == native.ChecksumError.status:
            record = self.pack.expert_record(layer, expert)
            error = ExpertChecksumError(
                f"checksum mismatch for {where}: crc32c {result['crc32c']:#010x}, manifest {record.crc32c:#010x}",
                layer, expert, offset, self.path)
            self.pack.damage.mark(damaged_record_of(error, record.length, result["crc32c"]))
            return error
        e = result["sys_errno"]
        reason = f"I/O error ({os.strerror(e)})" if e else "short read (the file is shorter than the index says)"
        return ExpertLoadError(f"{reason} reading {where}", layer, expert, offset, self.path)

    # ---- prefetch -----------------------------------------------------------------------

    def prefetch(self, layer: int, experts: Sequence[int]) -> int:
        """Starts reads of the predicted ``experts`` of ``layer`` that are not cached, without
        pinning them; returns reads started (0 when prefetch is off). Never blocks on I/O."""
        damaged = self.pack.damage.in_layer(layer)  # never read again: it would fail again
        ids = [int(e) for e in dict.fromkeys(int(e) for e in experts) if e not in damaged]
        self._predictions.note_predicted(layer, ids)
        if not self.prefetch_enabled or self.loading_pause is not None or not ids:
            return 0
        return self._cache.prefetch(layer, ids)

    # ---- run-time settings --------------------------------------------------------------

    def set_io_queue_depth(self, depth: int) -> None:
        """Reads in flight at most, from the next read on (the thermal watch lowers it)."""
        try:
            self._loader.set_queue_depth(depth)
        except native.InvalidArgumentError:
            raise ValueError(f"io_queue_depth must be in 1..{self._loader.info()['max_queue_depth']}, got {depth}") from None
        log.info("io_queue_depth = %d", depth)

    def set_prefetch(self, enabled: bool) -> None:
        self._prefetch_enabled = bool(enabled)
        log.info("prefetch %s", "on" if enabled else "off")

    def set_loading_paused(self, pause: LoadingPause | None) -> None:
        """Pause expert loading (misses fail with ExpertLoadingPaused, hits serve) or resume it (None)."""
        self._loading_pause = pause
        if pause is None:
            log.info("expert loading resumed")
        else:
            log.warning("expert loading paused: %s", pause.reason)

    def set_policy(self, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is unknown; use one of {', '.join(POLICIES)}")
        self._cache.set_policy(POLICIES[policy])
        self.policy = policy

    # ---- status -------------------------------------------------------------------------

    @property
    def region(self) -> np.ndarray | None:
        """The slab: all slots as one uint8 buffer (None once closed), for measuring residency."""
        return self.__dict__.get("_region") if self._slab is not None else None

    def backing_info(self) -> dict:
        """What the machine gave the cache: backing, lock, O_DIRECT, and every fallback."""
        slab, loader = self._slab.info(), self._loader.info()
        reservation = self._hugepages.grant
        return {
            "slots": self.n_slots,
            "slot_bytes": self.slot_bytes,
            "region_bytes": slab["region_bytes"],
            "backing": BACKING_NAMES[native.SlabBacking(slab["backing"])],
            "locked": bool(slab["locked"]),
            "lock_errno": errno_name(slab["lock_errno"]),
            "hugetlb_errno": errno_name(slab["hugetlb_errno"]),
            "thp_errno": errno_name(slab["thp_errno"]),
            "hugepages_added": reservation.pages_added if reservation else 0,
            "hugepages_message": reservation.message if reservation else None,
            "direct": bool(loader["direct"]),
            "direct_errno": errno_name(loader["direct_errno"]),
            "io_queue_depth": loader["queue_depth"],
            "max_io_queue_depth": loader["max_queue_depth"],
            "prefetch": self.prefetch_enabled,
            "loading_paused": self.loading_pause.reason if self.loading_pause else None,
            "policy": self.policy,
            "notes": list(self.notes),
        }

    def budget_status(self) -> dict:
        """The memory budget the cache was sized from, for status: how much, measured on what
        (MemAvailable or the cgroup limit), how hugetlb pages count, and what the cache took."""
        return {**self.budget.status(), "cache_size": self.cache_size_setting,
                "cache_bytes": self.n_slots * self.slot_bytes}

    def stats(self) -> dict:
        """Per-layer and total counters: hits, misses, bytes read, evictions, read latency
        percentiles (ms), prefetch issued/useful and prediction precision/recall."""
        return cache_stats(self._cache, self._loader, self._moe_layers(), self._predictions)

    def hits_and_misses(self) -> tuple[int, int]:
        counters = self.layer_counters().values()
        return sum(hits for hits, _ in counters), sum(misses for _, misses in counters)

    def summary(self) -> dict:
        """The counters and settings status shows; an in-flight hit (the read another request
        started) counts as a hit: this request did not cause a read."""
        stats = self.stats()
        total = stats["total"]
        return {"kind": "aepc", "resident_slots": stats["resident"],
                "hits": total.get("hits", 0) + total.get("inflight_hits", 0),
                "misses": total.get("misses", 0), "bytes_read": total.get("bytes_read", 0),
                "read_busy_s": stats["loader"]["busy_ns"] / 1e9,  # time with a read in flight: the disk's busy time
                "evictions": total.get("evictions", 0),
                "read_ms_p50": total.get("read_ms_p50"), "read_ms_p99": total.get("read_ms_p99"),
                "prediction_precision": total.get("prediction_precision"),
                "prediction_recall": total.get("prediction_recall"), **self.backing_info()}

    def layer_counters(self) -> dict[int, tuple[int, int]]:
        """(hits, misses) since start of each layer with experts; an in-flight hit counts as a hit."""
        return {layer: self._cache.layer_hits_and_misses(layer) for layer in self._moe_layers()}

    def _moe_layers(self) -> list[int]:
        """The layers with expert records (dense layers have none)."""
        return [layer for layer in range(self._cache.n_layers) if self._lengths[layer].any()]

    def reset_stats(self) -> None:
        self._cache.reset_stats()
        self._predictions.reset()

    def contains(self, layer: int, expert: int) -> bool:
        return self._cache.contains(layer, expert)

    # ---- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        """Waits for reads in flight, frees the slab and gives back hugetlb pages we added."""
        for name in ("_cache", "_loader", "_slab"):
            obj = self.__dict__.get(name)
            if obj is not None:
                obj.close()
                setattr(self, name, None)
        self.__dict__.pop("_region", None)
        self.__dict__.pop("_slot_views", None)
        self.return_hugepages()

    def return_hugepages(self) -> None:
        """Lowers vm.nr_hugepages by the pages this cache added; safe while the slab is still
        mapped (the kernel frees those pages when it is unmapped, at close or at exit)."""
        plan = self.__dict__.get("_hugepages")
        if plan is not None and plan.grant is not None:
            plan.grant.release()

    def __enter__(self) -> "CachedExpertSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
