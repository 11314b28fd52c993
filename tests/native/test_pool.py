"""The AEPC's C objects through their ctypes bindings: the slab's free map, the loader's
checked O_DIRECT reads, and the expert cache's pinning, LRU / LFRU eviction and prefetch —
on a synthetic experts file whose records are 4 KiB of a known pattern each."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from colibrid import native

PAGE = 4096
OFF, TRY, REQUIRED = native.AepcMode.OFF, native.AepcMode.TRY, native.AepcMode.REQUIRED


# ---- the slab --------------------------------------------------------------------------------


def test_slab_hands_out_the_lowest_free_slot_and_refuses_when_full():
    slab = native.Slab(2 * PAGE, 4, hugetlb=OFF, thp=OFF, lock=OFF)
    try:
        assert [slab.alloc() for _ in range(4)] == [0, 1, 2, 3]
        with pytest.raises(native.NoFreeSlotError):
            slab.alloc()
        slab.free(2)
        slab.free(0)
        assert slab.info()["n_free"] == 2
        assert slab.alloc() == 0 and slab.alloc() == 2
        with pytest.raises(native.InvalidArgumentError):
            slab.free(7)  # out of range
        slab.free(1)
        with pytest.raises(native.InvalidArgumentError):
            slab.free(1)  # already free: the map is unchanged
        assert slab.info()["n_free"] == 1
    finally:
        slab.close()


def test_slab_region_is_writable_and_sized_in_whole_slots():
    slab = native.Slab(3 * PAGE, 5, hugetlb=OFF, thp=OFF, lock=OFF)
    try:
        info = slab.info()
        assert info["backing"] == native.SlabBacking.PAGES and not info["locked"]
        assert info["region_bytes"] >= 15 * PAGE and slab.data.size == 15 * PAGE
        assert slab.data.ctypes.data % PAGE == 0  # O_DIRECT needs aligned slots
        slab.data[:] = 7
        assert int(slab.data.sum()) == 7 * 15 * PAGE
    finally:
        slab.close()


@pytest.mark.parametrize("slot_bytes, n_slots", [(1000, 4), (0, 4), (PAGE, 0), (-PAGE, 1)])
def test_slab_rejects_bad_sizes(slot_bytes, n_slots):
    with pytest.raises(native.InvalidArgumentError):
        native.Slab(slot_bytes, n_slots)


def test_slab_reports_the_backing_it_got():
    slab = native.Slab(PAGE, 600, hugetlb=OFF, thp=TRY, lock=TRY)  # 2.3 MiB
    try:
        info = slab.info()
        thp_on = "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
        if info["thp_errno"] == 0 and thp_on:
            assert info["backing"] == native.SlabBacking.THP
        else:
            assert info["backing"] == native.SlabBacking.PAGES
        assert info["locked"] == (info["lock_errno"] == 0)
    finally:
        slab.close()


def test_slab_create_and_destroy_many_times_leaves_no_mapping_behind():
    def mappings() -> int:
        return len(Path("/proc/self/maps").read_text().splitlines())

    native.Slab(16 * PAGE, 64, lock=TRY).close()  # warm up the allocator
    before = mappings()
    for i in range(300):
        slab = native.Slab(16 * PAGE, 8 + i % 64, hugetlb=OFF, thp=TRY if i % 2 else OFF, lock=TRY if i % 3 else OFF)
        slab.data[:: PAGE] = 1
        slab.close()
    assert mappings() <= before + 2


# ---- the loader -----------------------------------------------------------------------------


def _record(i: int, length: int = PAGE) -> np.ndarray:
    return ((np.arange(length, dtype=np.uint32) * 31 + i * 7919) % 251).astype(np.uint8)


@pytest.fixture
def experts_file(tmp_path) -> tuple[Path, list[np.ndarray]]:
    """16 records of 4 KiB, record i at offset i * 4096."""
    records = [_record(i) for i in range(16)]
    path = tmp_path / "experts.bin"
    path.write_bytes(b"".join(r.tobytes() for r in records))
    return path, records


def _aligned_buffer(n_bytes: int) -> tuple[native.Slab, np.ndarray]:
    slab = native.Slab(-(-n_bytes // PAGE) * PAGE, 1, hugetlb=OFF, thp=OFF, lock=OFF)
    return slab, slab.data


def test_loader_reads_records_with_o_direct_and_checks_them(experts_file):
    path, records = experts_file
    loader = native.Loader(path, queue_depth=4, max_queue_depth=8)
    slab, buf = _aligned_buffer(16 * PAGE)
    try:
        assert loader.info()["direct"] == 1 and loader.info()["file_bytes"] == 16 * PAGE
        reqs = [(buf[i * PAGE:(i + 1) * PAGE], i * PAGE, PAGE, native.crc32c(records[i])) for i in range(16)]
        status, results = loader.read(reqs)
        assert status == 0 and all(r["status"] == 0 and r["latency_ns"] > 0 for r in results)
        assert np.array_equal(buf, np.concatenate(records))
        info = loader.info()
        assert info["reads"] == 16 and info["bytes_read"] == 16 * PAGE and info["failures"] == 0
    finally:
        loader.close()
        slab.close()


def test_loader_reports_checksum_errors_short_reads_and_misaligned_buffers(experts_file):
    path, records = experts_file
    loader = native.Loader(path)
    slab, buf = _aligned_buffer(4 * PAGE)
    try:
        good = native.crc32c(records[1])
        status, results = loader.read([
            (buf[:PAGE], 0, PAGE, native.crc32c(records[0])),
            (buf[PAGE:2 * PAGE], PAGE, PAGE, good ^ 1),  # wrong checksum
            (buf[2 * PAGE:3 * PAGE], 16 * PAGE, PAGE, 0),  # past the end: short read
            (buf[3 * PAGE + 512:], 0, PAGE - 512, 0),  # not 4 KiB aligned
        ])
        assert status == native.ChecksumError.status  # the first failure in index order
        assert [r["status"] for r in results] == [0, 6, 5, 5]
        assert results[1]["crc32c"] == good
        assert results[2]["sys_errno"] == 0  # short read, not an errno
        assert results[3]["sys_errno"] == 22  # EINVAL: the caller's alignment, no fallback
        assert loader.info()["direct"] == 1 and loader.info()["failures"] == 3
    finally:
        loader.close()
        slab.close()


def test_loader_reads_expert_sized_records_whole_and_checked(tmp_path):
    """Records of a few MiB, as real experts are: every byte lands in place at any queue
    depth, a flipped last byte fails the checksum, and a record cut short by the end of the
    file is a short read."""
    mib = 1 << 20
    lengths = [3 * mib + 5 * PAGE, mib, 2 * mib + PAGE]
    offsets = np.cumsum([0] + lengths[:-1]).tolist()
    records = [_record(i, n) for i, n in enumerate(lengths)]
    path = tmp_path / "big.bin"
    path.write_bytes(b"".join(r.tobytes() for r in records))
    total = sum(lengths)
    slab, buf = _aligned_buffer(total + 2 * mib)
    try:
        for depth in (1, 3, 16):
            loader = native.Loader(path, queue_depth=depth, max_queue_depth=16)
            try:
                buf[:] = 0
                reqs = [(buf[o:o + n], o, n, native.crc32c(r)) for o, n, r in zip(offsets, lengths, records)]
                status, results = loader.read(reqs)
                assert status == 0 and [r["status"] for r in results] == [0, 0, 0]
                assert np.array_equal(buf[:total], np.concatenate(records))
                assert loader.info()["reads"] == 3 and loader.info()["bytes_read"] == total
            finally:
                loader.close()
        damaged = bytearray(path.read_bytes())
        damaged[lengths[0] - 1] ^= 0x40  # the first record's last byte
        path.write_bytes(bytes(damaged))
        loader = native.Loader(path)
        try:
            status, results = loader.read([
                (buf[:lengths[0]], 0, lengths[0], native.crc32c(records[0])),
                (buf[total:total + 2 * mib], total - mib, 2 * mib, 0),  # its second MiB is past the end
            ])
            assert [r["status"] for r in results] == [native.ChecksumError.status, 5]
            assert results[0]["crc32c"] == native.crc32c(np.frombuffer(bytes(damaged[:lengths[0]]), np.uint8))
            assert results[1]["sys_errno"] == 0 and loader.info()["failures"] == 2
        finally:
            loader.close()
    finally:
        slab.close()


def test_loader_queue_depth_changes_at_run_time(experts_file):
    path, records = experts_file
    loader = native.Loader(path, queue_depth=2, max_queue_depth=4)
    slab, buf = _aligned_buffer(16 * PAGE)
    try:
        for depth in (1, 4, 3):
            loader.set_queue_depth(depth)
            assert loader.info()["queue_depth"] == depth
            reqs = [(buf[i * PAGE:(i + 1) * PAGE], i * PAGE, PAGE, native.crc32c(records[i])) for i in range(16)]
            assert loader.read(reqs)[0] == 0
        for bad in (0, 5):
            with pytest.raises(native.InvalidArgumentError):
                loader.set_queue_depth(bad)
        assert loader.info()["queue_depth"] == 3
    finally:
        loader.close()
        slab.close()


def test_loader_on_a_missing_file_is_a_clean_error(tmp_path):
    with pytest.raises(native.ReadError, match="No such file"):
        native.Loader(tmp_path / "nope.bin")


# ---- the expert cache -------------------------------------------------------------------------

L, E = 2, 8


class Cache:
    """A col_expert_cache over the 16-record file: (layer l, expert e) is record l * 8 + e."""

    def __init__(self, path: Path, records: list[np.ndarray], n_slots: int, policy=native.CachePolicy.LRU,
                 decay_half_life: int = 0):
        self.records = records
        self.slab = native.Slab(PAGE, n_slots, hugetlb=OFF, thp=OFF, lock=OFF)
        self.loader = native.Loader(path, queue_depth=4, max_queue_depth=4)
        table = np.zeros((L, E), dtype=native.EXPERT_RECORD_DTYPE)
        for i, rec in enumerate(records):
            table[i // E, i % E] = (i * PAGE, PAGE, native.crc32c(rec), 0)
        self.core = native.ExpertCacheCore(self.slab, self.loader, table, policy, decay_half_life=decay_half_life)

    def use(self, layer: int, experts: list[int]) -> np.ndarray:
        """acquire + wait + check the bytes + release; returns the slots."""
        slots = self.core.acquire(layer, experts)
        try:
            status, _ = self.core.wait(slots)
            assert status == 0
            for e, s in zip(experts, slots):
                assert np.array_equal(self.slab.data[s * PAGE:(s + 1) * PAGE], self.records[layer * E + e])
        finally:
            self.core.release(slots)
        return slots

    def resident(self) -> set[tuple[int, int]]:
        return {(layer, e) for layer in range(L) for e in range(E) if self.core.contains(layer, e)}

    def close(self):
        self.core.close()
        self.loader.close()
        self.slab.close()


@pytest.fixture
def make_cache(experts_file):
    made = []

    def make(n_slots: int, policy=native.CachePolicy.LRU, decay_half_life: int = 0) -> Cache:
        made.append(Cache(*experts_file, n_slots, policy, decay_half_life))
        return made[-1]

    yield make
    for cache in made:
        cache.close()


def test_cache_hits_after_the_first_load(make_cache):
    cache = make_cache(4)
    cache.use(0, [1, 2])
    cache.use(0, [2, 1])
    st = cache.core.layer_stats(0)
    assert (st["misses"], st["hits"], st["loads"], st["bytes_read"], st["evictions"]) == (2, 2, 2, 2 * PAGE, 0)
    assert sum(st["latency_us"]) == 2
    assert cache.core.count() == (2, 0)


def test_lru_evicts_the_least_recently_used(make_cache):
    cache = make_cache(3)
    for e in (0, 1, 2):
        cache.use(0, [e])
    cache.use(0, [0])  # 0 is now the most recent; 1 the least
    cache.use(0, [3])
    assert cache.resident() == {(0, 0), (0, 2), (0, 3)}
    cache.use(1, [5])  # evicts 2
    assert cache.resident() == {(0, 0), (0, 3), (1, 5)}
    assert cache.core.layer_stats(0)["evictions"] == 2


def test_pinned_experts_are_never_evicted(make_cache):
    cache = make_cache(3)
    held = cache.core.acquire(0, [0, 1])
    assert cache.core.wait(held)[0] == 0
    for e in range(2, 8):  # cycles through the one unpinned slot
        cache.use(0, [e])
        assert {(0, 0), (0, 1)} <= cache.resident()
    with pytest.raises(native.NoFreeSlotError):
        cache.core.acquire(1, [0, 1])  # needs two slots, one is free to evict
    assert cache.core.count() == (3, 2)  # the failed acquire left nothing pinned
    cache.core.release(held)
    cache.use(1, [0, 1, 2])
    assert cache.resident() == {(1, 0), (1, 1), (1, 2)}
    with pytest.raises(native.InvalidArgumentError):
        cache.core.release(held)  # not pinned any more


def test_acquire_rejects_bad_requests_without_pinning(make_cache):
    cache = make_cache(4)
    for layer, experts in ((0, [1, 1]), (2, [0]), (0, [8]), (-1, [0])):
        with pytest.raises(native.InvalidArgumentError):
            cache.core.acquire(layer, experts)
    assert cache.core.count() == (0, 0)


def test_a_cache_of_one_slot_serves_every_expert_in_turn(make_cache):
    cache = make_cache(1)
    for layer in range(L):
        for e in range(E):
            cache.use(layer, [e])
    assert cache.core.count() == (1, 0)


def test_lfru_keeps_each_layers_quota_and_its_frequent_experts(make_cache):
    cache = make_cache(4, native.CachePolicy.LFRU)  # quota: 2 slots per layer
    for _ in range(3):
        cache.use(0, [0])
        cache.use(0, [1])
    for e in range(8):  # a scan of layer 1 takes only layer 1's quota
        cache.use(1, [e])
    assert {(0, 0), (0, 1)} <= cache.resident()
    lru = make_cache(4)
    for _ in range(3):
        lru.use(0, [0])
        lru.use(0, [1])
    for e in range(8):
        lru.use(1, [e])
    assert not {(0, 0), (0, 1)} & lru.resident()  # LRU lets the scan flush layer 0
    cache.use(0, [2])  # layer 0 is at its quota: it gives up one of its own (equal counts: the older)
    assert {(0, 1), (0, 2)} <= cache.resident() and (0, 0) not in cache.resident()


def _requests(cache, sequence: list[tuple[tuple[int, int], int]]) -> None:
    for (layer, expert), times in sequence:
        for _ in range(times):
            cache.use(layer, [expert])


A, B, C, D = (0, 0), (0, 1), (0, 2), (1, 0)


@pytest.mark.parametrize("policy, evicted", [(native.CachePolicy.DECAYED_LFU, B), (native.CachePolicy.LRU, A)])
def test_decayed_lfu_keeps_an_expert_used_often_over_one_used_a_little_more_recently(make_cache, policy, evicted):
    """Half-life 4 requests. A six times (requests 1-6), B twice (7-8), C 13 times, then D misses.
    Decayed to request 8: A's score is sum(2^(-i/4), i<6) * 2^(-2/4) = 2.87, B's 1 + 2^(-1/4) = 1.84:
    B goes. LRU takes A, the least recent."""
    cache = make_cache(3, policy, decay_half_life=4)
    _requests(cache, [(A, 6), (B, 2), (C, 13), (D, 1)])
    assert cache.resident() == {A, B, C, D} - {evicted}


@pytest.mark.parametrize("policy, evicted", [(native.CachePolicy.DECAYED_LFU, A), (native.CachePolicy.LFRU, B)])
def test_decayed_lfu_forgets_what_was_used_often_long_ago(make_cache, policy, evicted):
    """The same requests with C's 13 between A and B: decayed to request 21, A's score is
    4.06 * 2^(-15/4) = 0.30 against B's 1.84, so A goes; counting (LFRU, no halving yet) keeps
    A's 6 over B's 2."""
    cache = make_cache(3, policy, decay_half_life=4)
    _requests(cache, [(A, 6), (C, 13), (B, 2), (D, 1)])
    assert cache.resident() == {A, B, C, D} - {evicted}


@pytest.mark.parametrize("policy, evicted", [(native.CachePolicy.NEXT_USE, (1, 0)), (native.CachePolicy.LRU, (0, 0))])
def test_next_use_evicts_the_expert_whose_layer_comes_round_last(make_cache, policy, evicted):
    """(0,0) and (1,0) are requested in one pass over the layers, (0,1) in the next (layer 0 after
    layer 1: a new token). At a miss of layer 1, (0,0) and (1,0) have the same rate, but layer 0
    comes round one step from now and layer 1 a whole pass: (1,0) goes. LRU takes (0,0)."""
    cache = make_cache(3, policy)
    _requests(cache, [((0, 0), 1), ((1, 0), 1), ((0, 1), 1), ((1, 1), 1)])
    assert cache.resident() == {(0, 0), (1, 0), (0, 1), (1, 1)} - {evicted}


def test_prefetch_loads_without_pinning_and_counts_useful_prefetches(make_cache):
    cache = make_cache(4)
    assert cache.core.prefetch(1, [3, 4]) == 2
    assert cache.core.prefetch(1, [3]) == 0  # already on its way
    cache.use(1, [3])
    st = cache.core.layer_stats(1)
    assert st["prefetch_issued"] == 2 and st["prefetch_useful"] == 1
    assert st["hits"] + st["inflight_hits"] == 1 and st["misses"] == 0
    assert cache.core.count()[1] == 0


def _wait_until_loaded(cache, layer: int, expert: int) -> None:
    deadline = time.monotonic() + 10
    while not cache.core.contains(layer, expert):
        assert time.monotonic() < deadline, "prefetch never landed"
        time.sleep(0.001)


def test_a_wrong_prefetch_is_evicted_before_experts_that_were_used(make_cache):
    """LRU: a prefetched expert counts as used long ago until it is requested, so a wrong
    guess goes first; a right guess, once requested, is as recent as any hit."""
    cache = make_cache(3)
    cache.use(0, [0])
    cache.use(0, [1])  # (0, 0) is now the least recently used expert
    cache.core.prefetch(1, [2])
    _wait_until_loaded(cache, 1, 2)
    cache.use(0, [3])  # a miss with the cache full: the unrequested prefetch is the victim
    assert cache.resident() == {(0, 0), (0, 1), (0, 3)}
    cache.core.prefetch(1, [4])  # evicts (0, 0), the least recently used
    _wait_until_loaded(cache, 1, 4)
    cache.use(1, [4])  # requested: now the most recent
    cache.use(0, [5])  # the victim is (0, 1), not the prefetch that was used
    assert cache.resident() == {(0, 3), (1, 4), (0, 5)}


def test_prefetch_is_skipped_when_nothing_can_be_evicted(make_cache):
    cache = make_cache(3)
    held = cache.core.acquire(0, [0, 1])
    cache.core.wait(held)
    assert cache.core.prefetch(1, [0, 1, 2]) == 1  # one free slot
    # the one unpinned slot holds an unused prefetch: prefetch does not evict it
    assert cache.core.prefetch(1, [5]) == 0
    st = cache.core.layer_stats(1)
    assert st["prefetch_issued"] == 1 and st["prefetch_skipped"] == 3
    cache.core.release(held)


def test_a_failed_load_is_reported_and_its_slot_returned(experts_file, tmp_path):
    path, records = experts_file
    data = bytearray(path.read_bytes())
    data[3 * PAGE + 100] ^= 0xFF  # (layer 0, expert 3)
    path.write_bytes(bytes(data))
    cache = Cache(path, records, 2)
    try:
        slots = cache.core.acquire(0, [2, 3])
        status, results = cache.core.wait(slots)
        assert status == native.ChecksumError.status
        assert [r["status"] for r in results] == [0, 6]
        cache.core.release(slots)
        assert cache.resident() == {(0, 2)} and cache.slab.info()["n_free"] == 1
        cache.use(0, [4])  # the next request succeeds
        data[3 * PAGE + 100] ^= 0xFF
        path.write_bytes(bytes(data))
        cache.use(0, [3])  # read again, not served from a stale slot
        assert cache.core.layer_stats(0)["load_failures"] == 1
    finally:
        cache.close()


def test_many_threads_acquire_concurrently(make_cache):
    import threading

    cache = make_cache(6)
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(200):
                layer = int(rng.integers(0, L))
                experts = [int(e) for e in rng.choice(E, size=2, replace=False)]
                while True:
                    try:
                        cache.use(layer, experts)
                        break
                    except native.NoFreeSlotError:
                        pass  # the other threads hold the slots: try again
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert cache.core.count()[1] == 0
