"""The Active Expert Page Cache (AEPC) bindings: the slab pool of slots (Slab), the
O_DIRECT loader (Loader) and the (layer, expert) -> slot cache over them (ExpertCacheCore).

Shape letters: S slots, L layers, E experts per layer, N experts in a call."""

from __future__ import annotations

import ctypes
import enum
import os
from pathlib import Path

import numpy as np

from colibrid.native.arguments import _as_count
from colibrid.native.errors import InvalidArgumentError, Status
from colibrid.native.library import _SIGNATURES, _lib, check, mirrored_size, mirrors_c_struct, status_error


class AepcMode(enum.IntEnum):
    """col_aepc_mode: how hard to try for hugetlb pages, THP, mlock, O_DIRECT."""

    OFF = 0
    TRY = 1
    REQUIRED = 2


class SlabBacking(enum.IntEnum):
    PAGES = 0
    THP = 1
    HUGETLB = 2


class CachePolicy(enum.IntEnum):
    LRU = 0
    LFRU = 1
    DECAYED_LFU = 2
    NEXT_USE = 3


LATENCY_BUCKETS = 96  # COL_LATENCY_BUCKETS


def latency_bucket_lower_us(bucket: int) -> float:
    """Lower edge (microseconds) of a read-latency histogram bucket (see colibri.h)."""
    if bucket < 4:
        return 0.0
    return ((4 + bucket % 4) << (bucket // 4)) / 8.0


@mirrors_c_struct("col_slab_params_size")
class SlabParams(ctypes.Structure):
    _fields_ = [("slot_bytes", ctypes.c_int64), ("n_slots", ctypes.c_int64), ("hugetlb", ctypes.c_int32),
                ("thp", ctypes.c_int32), ("lock", ctypes.c_int32), ("reserved", ctypes.c_int32)]


@mirrors_c_struct("col_slab_info_size")
class SlabInfo(ctypes.Structure):
    _fields_ = [("slot_bytes", ctypes.c_int64), ("n_slots", ctypes.c_int64), ("region_bytes", ctypes.c_int64),
                ("n_free", ctypes.c_int64), ("backing", ctypes.c_int32), ("locked", ctypes.c_int32),
                ("hugetlb_errno", ctypes.c_int32), ("thp_errno", ctypes.c_int32), ("lock_errno", ctypes.c_int32),
                ("mmap_errno", ctypes.c_int32)]


@mirrors_c_struct("col_loader_params_size")
class LoaderParams(ctypes.Structure):
    _fields_ = [("max_queue_depth", ctypes.c_int32), ("queue_depth", ctypes.c_int32), ("direct", ctypes.c_int32),
                ("reserved", ctypes.c_int32)]


@mirrors_c_struct("col_loader_info_size")
class LoaderInfo(ctypes.Structure):
    _fields_ = [("direct", ctypes.c_int32), ("direct_errno", ctypes.c_int32), ("queue_depth", ctypes.c_int32),
                ("max_queue_depth", ctypes.c_int32), ("reads", ctypes.c_int64), ("bytes_read", ctypes.c_int64),
                ("failures", ctypes.c_int64), ("busy_ns", ctypes.c_int64), ("file_bytes", ctypes.c_int64)]


@mirrors_c_struct("col_read_size")
class ReadRequest(ctypes.Structure):
    _fields_ = [("dst", ctypes.c_void_p), ("offset", ctypes.c_int64), ("length", ctypes.c_int64),
                ("crc32c", ctypes.c_uint32), ("reserved", ctypes.c_int32)]


@mirrors_c_struct("col_read_result_size")
class ReadResult(ctypes.Structure):
    _fields_ = [("status", ctypes.c_int32), ("sys_errno", ctypes.c_int32), ("crc32c", ctypes.c_uint32),
                ("reserved", ctypes.c_int32), ("latency_ns", ctypes.c_int64)]


@mirrors_c_struct("col_expert_cache_params_size")
class ExpertCacheParams(ctypes.Structure):
    _fields_ = [("n_layers", ctypes.c_int32), ("n_experts", ctypes.c_int32), ("policy", ctypes.c_int32),
                ("wait_for_pins", ctypes.c_int32), ("decay_half_life", ctypes.c_int32),
                ("next_use_half_life", ctypes.c_int32)]


@mirrors_c_struct("col_expert_cache_layer_stats_size")
class ExpertCacheLayerStats(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in (
        "hits", "inflight_hits", "misses", "loads", "load_failures", "bytes_read", "evictions",
        "prefetch_issued", "prefetch_useful", "prefetch_skipped")] + [("latency_us", ctypes.c_int64 * LATENCY_BUCKETS)]


@mirrors_c_struct("col_expert_load_result_size")
class ExpertLoadResult(ctypes.Structure):
    _fields_ = [("status", ctypes.c_int32), ("sys_errno", ctypes.c_int32), ("crc32c", ctypes.c_uint32),
                ("reserved", ctypes.c_int32)]


# col_expert_record as a numpy dtype, so an index of L * E records is built without a Python loop
EXPERT_RECORD_DTYPE = np.dtype([("offset", "<i8"), ("length", "<i8"), ("crc32c", "<u4"), ("reserved", "<i4")])

mirrored_size("EXPERT_RECORD_DTYPE", EXPERT_RECORD_DTYPE.itemsize, "col_expert_record_size")

_vp, _i32 = ctypes.c_void_p, ctypes.c_int32
_i32_p = ctypes.POINTER(ctypes.c_int32)
_SIGNATURES.update({
    "col_slab_default_params": (SlabParams, []),
    "col_slab_create": (ctypes.c_int, [ctypes.POINTER(SlabParams), ctypes.POINTER(_vp), ctypes.POINTER(SlabInfo)]),
    "col_slab_destroy": (None, [_vp]),
    "col_slab_get_info": (ctypes.c_int, [_vp, ctypes.POINTER(SlabInfo)]),
    "col_slab_data": (_vp, [_vp]),
    "col_slab_slot_alloc": (ctypes.c_int, [_vp, _i32_p]),
    "col_slab_slot_free": (ctypes.c_int, [_vp, _i32]),
    "col_loader_default_params": (LoaderParams, []),
    "col_loader_create": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(LoaderParams), ctypes.POINTER(_vp), _i32_p]),
    "col_loader_create_fd": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(LoaderParams), ctypes.POINTER(_vp), _i32_p]),
    "col_loader_destroy": (None, [_vp]),
    "col_loader_get_info": (ctypes.c_int, [_vp, ctypes.POINTER(LoaderInfo)]),
    "col_loader_set_queue_depth": (ctypes.c_int, [_vp, _i32]),
    # (loader, reads (N), n, results (N))
    "col_loader_read": (ctypes.c_int, [_vp, _vp, _i32, _vp]),
    "col_expert_cache_default_params": (ExpertCacheParams, []),
    # (params, records (L * E), slab, loader, out)
    "col_expert_cache_create": (ctypes.c_int, [ctypes.POINTER(ExpertCacheParams), _vp, _vp, _vp, ctypes.POINTER(_vp)]),
    "col_expert_cache_destroy": (None, [_vp]),
    # (cache, layer, experts (N) i32, n, slots (N) i32 out)
    "col_expert_cache_acquire": (ctypes.c_int, [_vp, _i32, _vp, _i32, _vp]),
    # (cache, slots (N), n, results (N) out or NULL)
    "col_expert_cache_wait": (ctypes.c_int, [_vp, _vp, _i32, _vp]),
    "col_expert_cache_release": (ctypes.c_int, [_vp, _vp, _i32]),
    # (cache, layer, experts (N), n, issued out)
    "col_expert_cache_prefetch": (ctypes.c_int, [_vp, _i32, _vp, _i32, _i32_p]),
    "col_expert_cache_get_stats": (ctypes.c_int, [_vp, _i32, ctypes.POINTER(ExpertCacheLayerStats)]),
    "col_expert_cache_reset_stats": (None, [_vp]),
    "col_expert_cache_count": (ctypes.c_int, [_vp, _i32_p, _i32_p]),
    "col_expert_cache_contains": (ctypes.c_int, [_vp, _i32, _i32]),
    "col_expert_cache_set_policy": (ctypes.c_int, [_vp, _i32]),
})

def _struct_dict(s: ctypes.Structure) -> dict:
    return {name: getattr(s, name) for name, *_ in s._fields_ if name != "reserved"}


def _i32_array(values, name: str) -> np.ndarray:
    arr = np.ascontiguousarray(np.asarray(values, dtype=np.int64).reshape(-1))
    if arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
        raise InvalidArgumentError(f"{name} must fit in int32")
    return arr.astype(np.int32)


class Slab:
    """One col_slab: a region of ``n_slots`` slots of ``slot_bytes``, and its free map.

    ``data`` is a uint8 (S * slot_bytes,) view of the region, valid until close()."""

    _handle = None  # set once the C object exists (close() and __del__ check it)

    def __init__(self, slot_bytes: int, n_slots: int, hugetlb: AepcMode = AepcMode.TRY,
                 thp: AepcMode = AepcMode.TRY, lock: AepcMode = AepcMode.TRY) -> None:
        lib = _lib()
        params = lib.col_slab_default_params()
        params.slot_bytes = _as_count(slot_bytes, "slot_bytes")
        params.n_slots = _as_count(n_slots, "n_slots")
        params.hugetlb, params.thp, params.lock = int(hugetlb), int(thp), int(lock)
        handle, info = _vp(), SlabInfo()
        status = lib.col_slab_create(ctypes.byref(params), ctypes.byref(handle), ctypes.byref(info))
        if status:
            error = status_error(status, f"slab of {n_slots} x {slot_bytes} bytes")
            error.info = _struct_dict(info)  # what the OS refused, and its errno
            raise error
        self._handle = handle
        self.slot_bytes = int(slot_bytes)
        self.n_slots = int(n_slots)
        base = lib.col_slab_data(handle)
        self.data = np.ctypeslib.as_array((ctypes.c_uint8 * (self.slot_bytes * self.n_slots)).from_address(base))

    @property
    def handle(self) -> ctypes.c_void_p:
        if not self._handle:
            raise InvalidArgumentError("the slab is closed")
        return self._handle

    def info(self) -> dict:
        """backing (SlabBacking), locked, region_bytes, n_free and the errno of each refusal."""
        info = SlabInfo()
        check(_lib().col_slab_get_info(self.handle, ctypes.byref(info)), "slab info")
        return _struct_dict(info)

    def alloc(self) -> int:
        """Takes the lowest free slot; NoFreeSlotError when none is free."""
        slot = ctypes.c_int32(-1)
        check(_lib().col_slab_slot_alloc(self.handle, ctypes.byref(slot)), "slab slot alloc")
        return slot.value

    def free(self, slot: int) -> None:
        check(_lib().col_slab_slot_free(self.handle, int(slot)), f"slab slot free {slot}")

    def close(self) -> None:
        if self._handle:
            self.data = None
            _lib().col_slab_destroy(self._handle)
            self._handle = None

    def __del__(self) -> None:
        self.close()


class Loader:
    """One col_loader on ``path``: I/O threads reading records with O_DIRECT, crc32c checked."""

    _handle = None  # set once the C object exists (close() and __del__ check it)

    def __init__(self, path: str | os.PathLike, queue_depth: int = 16, max_queue_depth: int = 32,
                 direct: AepcMode = AepcMode.TRY, fd: int | None = None) -> None:
        """Reads ``path``; or, given ``fd`` (an open file or block device, still the caller's to
        close), reads that file and ``path`` only names it in messages."""
        lib = _lib()
        params = lib.col_loader_default_params()
        params.queue_depth, params.max_queue_depth, params.direct = int(queue_depth), int(max_queue_depth), int(direct)
        handle, err = _vp(), ctypes.c_int32(0)
        if fd is None:
            status = lib.col_loader_create(os.fsencode(path), ctypes.byref(params), ctypes.byref(handle), ctypes.byref(err))
        else:
            status = lib.col_loader_create_fd(int(fd), ctypes.byref(params), ctypes.byref(handle), ctypes.byref(err))
        check(status, f"opening {path} for expert reads", err.value)
        self._handle = handle
        self.path = Path(path)

    @property
    def handle(self) -> ctypes.c_void_p:
        if not self._handle:
            raise InvalidArgumentError("the loader is closed")
        return self._handle

    def info(self) -> dict:
        info = LoaderInfo()
        check(_lib().col_loader_get_info(self.handle, ctypes.byref(info)), "loader info")
        return _struct_dict(info)

    def set_queue_depth(self, depth: int) -> None:
        check(_lib().col_loader_set_queue_depth(self.handle, int(depth)), f"loader queue depth {depth}")

    def read(self, requests: list[tuple[np.ndarray, int, int, int]]) -> tuple[int, list[dict]]:
        """Reads each (dst uint8 array, offset, length, crc32c) and waits for all (GIL
        released). Returns (status of the first failure or 0, a result dict per read)."""
        n = len(requests)
        reads, results = (ReadRequest * n)(), (ReadResult * n)()
        for i, (dst, offset, length, crc) in enumerate(requests):
            if not isinstance(dst, np.ndarray) or not dst.flags.c_contiguous or dst.nbytes < length:
                raise InvalidArgumentError(f"read {i}: dst must be a contiguous array of at least {length} bytes")
            reads[i].dst, reads[i].offset, reads[i].length, reads[i].crc32c = dst.ctypes.data, offset, length, crc
        status = _lib().col_loader_read(self.handle, ctypes.addressof(reads), n, ctypes.addressof(results))
        if status not in (Status.OK, Status.EIO, Status.ECHECKSUM):  # per-read failures are in the results
            check(status, "loader read")
        return status, [_struct_dict(r) for r in results]

    def close(self) -> None:
        if self._handle:
            _lib().col_loader_destroy(self._handle)
            self._handle = None

    def __del__(self) -> None:
        self.close()


class ExpertCacheCore:
    """One col_expert_cache over a Slab and a Loader (C keeps them alive until it is closed).

    ``records`` is an EXPERT_RECORD_DTYPE array (L, E): where each record lives.
    ``wait_for_pins``: acquire waits for other threads' releases instead of raising
    NoFreeSlotError (never acquire twice in one thread without releasing, then).
    ``decay_half_life``: DECAYED_LFU's half-life in requested experts (0: the C default)."""

    _handle = None  # set once the C object exists (close() and __del__ check it)

    def __init__(self, slab: Slab, loader: Loader, records: np.ndarray, policy: CachePolicy = CachePolicy.LRU,
                 wait_for_pins: bool = False, decay_half_life: int = 0) -> None:
        lib = _lib()
        if not isinstance(records, np.ndarray) or records.dtype != EXPERT_RECORD_DTYPE or records.ndim != 2:
            raise InvalidArgumentError("records must be an (L, E) array of EXPERT_RECORD_DTYPE")
        self._records = np.ascontiguousarray(records)
        params = lib.col_expert_cache_default_params()
        params.n_layers, params.n_experts, params.policy = records.shape[0], records.shape[1], int(policy)
        params.wait_for_pins = int(bool(wait_for_pins))
        params.decay_half_life = int(decay_half_life)  # requests; 0: C's default
        handle = _vp()
        check(lib.col_expert_cache_create(ctypes.byref(params), self._records.ctypes.data, slab.handle,
                                                loader.handle, ctypes.byref(handle)), "expert cache")
        self._handle = handle
        self.n_layers, self.n_experts = records.shape
        self._slab, self._loader = slab, loader  # kept alive for as long as the cache

    @property
    def handle(self) -> ctypes.c_void_p:
        if not self._handle:
            raise InvalidArgumentError("the expert cache is closed")
        return self._handle

    def acquire(self, layer: int, experts) -> np.ndarray:
        """Pins the N distinct ``experts`` of ``layer`` and starts the reads of the misses;
        returns their slots, int32 (N,). NoFreeSlotError: not enough unpinned slots (nothing
        stays pinned)."""
        ids = _i32_array(experts, "experts")
        slots = np.empty(ids.size, dtype=np.int32)
        check(_lib().col_expert_cache_acquire(self.handle, int(layer), ids.ctypes.data, ids.size,
                                                         slots.ctypes.data), f"acquire layer {layer}")
        return slots

    def wait(self, slots: np.ndarray) -> tuple[int, list[dict]]:
        """Blocks (GIL released) until every slot is loaded or failed: (first failure status
        or 0, per-slot {status, sys_errno, crc32c})."""
        slots = _i32_array(slots, "slots")
        results = (ExpertLoadResult * slots.size)()
        status = _lib().col_expert_cache_wait(self.handle, slots.ctypes.data, slots.size, ctypes.addressof(results))
        if status not in (Status.OK, Status.EIO, Status.ECHECKSUM):  # per-read failures are in the results
            check(status, "wait")
        return status, [_struct_dict(r) for r in results]

    def release(self, slots: np.ndarray) -> None:
        slots = _i32_array(slots, "slots")
        check(_lib().col_expert_cache_release(self.handle, slots.ctypes.data, slots.size), "release")

    def prefetch(self, layer: int, experts) -> int:
        """Starts reads of those experts not in the cache, without pinning; returns reads started."""
        ids = _i32_array(experts, "experts")
        issued = ctypes.c_int32(0)
        check(_lib().col_expert_cache_prefetch(self.handle, int(layer), ids.ctypes.data, ids.size,
                                                          ctypes.byref(issued)), f"prefetch layer {layer}")
        return issued.value

    def layer_stats(self, layer: int) -> dict:
        """Counters of one layer; ``latency_us`` is the histogram as a list of LATENCY_BUCKETS."""
        st = ExpertCacheLayerStats()
        check(_lib().col_expert_cache_get_stats(self.handle, int(layer), ctypes.byref(st)), "stats")
        out = _struct_dict(st)
        out["latency_us"] = list(st.latency_us)
        return out

    def layer_hits_and_misses(self, layer: int) -> tuple[int, int]:
        """Hits (in-flight ones included) and misses of one layer: the two counters alone,
        without building layer_stats' dict and histogram (read around every batch step)."""
        st = ExpertCacheLayerStats()
        check(_lib().col_expert_cache_get_stats(self.handle, int(layer), ctypes.byref(st)), "stats")
        return st.hits + st.inflight_hits, st.misses

    def reset_stats(self) -> None:
        _lib().col_expert_cache_reset_stats(self.handle)

    def count(self) -> tuple[int, int]:
        """(experts resident or loading, slots pinned)."""
        resident, pinned = ctypes.c_int32(0), ctypes.c_int32(0)
        check(_lib().col_expert_cache_count(self.handle, ctypes.byref(resident), ctypes.byref(pinned)), "count")
        return resident.value, pinned.value

    def contains(self, layer: int, expert: int) -> bool:
        return bool(_lib().col_expert_cache_contains(self.handle, int(layer), int(expert)))

    def set_policy(self, policy: CachePolicy) -> None:
        check(_lib().col_expert_cache_set_policy(self.handle, int(policy)), f"policy {policy}")

    def close(self) -> None:
        if self._handle:
            _lib().col_expert_cache_destroy(self._handle)
            self._handle = None

    def __del__(self) -> None:
        self.close()
