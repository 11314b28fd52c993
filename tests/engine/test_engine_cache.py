"""The engine owns its expert cache: it builds it from settings, rebuilds it (keeping the old
one when the new one cannot be had), carries the loader's limits over to every cache it
builds, and answers for it in status - the daemon never touches the source itself."""

from __future__ import annotations

import os

import numpy as np
import pytest

PROMPT = [5, 17, 42, 99, 3, 250, 7, 61, 11, 200, 31, 8]


@pytest.fixture(scope="module")
def reference(demo_pack):
    from colibrid.engine.engine import Engine
    from colibrid.pack.reader import Pack

    engine = Engine(Pack.open(demo_pack))  # plain preads
    try:
        return engine.forward(PROMPT)
    finally:
        engine.close()


def _slot_bytes(pack_path) -> int:
    from colibrid.pack.reader import Pack

    return -(-max(r.length for r in Pack.open(pack_path).manifest.expert_records) // 4096) * 4096


def _settings(pack_path, slots: int, **changes):
    from colibrid.engine.experts.cache import ExpertCacheSettings

    return ExpertCacheSettings(cache_size=slots * _slot_bytes(pack_path), hugepages="off", lock_memory="off",
                               **changes)


@pytest.fixture
def engine(demo_pack):
    from colibrid.engine.engine import Engine
    from colibrid.pack.reader import Pack

    made = Engine(Pack.open(demo_pack), cache=_settings(demo_pack, 3))
    yield made
    made.close()


def test_the_engine_builds_its_cache_from_settings_and_reports_it(engine, reference, demo_pack):
    status = engine.cache_status()
    assert status["kind"] == "aepc" and status["slots"] == 3 and status["policy"] == "next-use"
    budget = engine.memory_budget()
    assert budget["cache_bytes"] == 3 * _slot_bytes(demo_pack) and budget["cache_size"] == 3 * _slot_bytes(demo_pack)
    assert np.array_equal(engine.forward(PROMPT), reference)
    engine.set_cache_policy("lfru")
    assert engine.cache_status()["policy"] == "lfru"


@pytest.mark.parametrize("prefetch", [False, True])
def test_status_names_the_lookahead_predictor_only_while_prefetch_is_on(demo_pack, prefetch):
    from colibrid.engine.engine import Engine
    from colibrid.pack.reader import Pack

    engine = Engine(Pack.open(demo_pack), cache=_settings(demo_pack, 3, prefetch=prefetch),
                    lookahead_predictor="router-on-residual")
    try:
        status = engine.cache_status()
        assert status["prefetch"] is prefetch
        assert status.get("lookahead_predictor") == ("router-on-residual" if prefetch else None)
    finally:
        engine.close()


def test_a_rebuild_swaps_in_a_new_cache_and_frees_the_old(engine, reference, demo_pack):
    old = engine.experts
    engine.forward(PROMPT)
    assert engine.rebuild_cache(_settings(demo_pack, 8, policy="lfru")) is True
    assert engine.experts is not old and engine.cache_status()["slots"] == 8
    assert engine.cache_status()["policy"] == "lfru" and engine.cache_status()["misses"] == 0  # a fresh cache
    assert engine.memory_budget()["cache_bytes"] == 8 * _slot_bytes(demo_pack)
    with pytest.raises(AttributeError):
        old.stats()  # closed: its slab and loader are gone
    assert np.array_equal(engine.forward(PROMPT), reference)
    assert engine.rebuild_cache() is True  # again as it is: a fresh descriptor of the experts file
    assert engine.cache_status()["slots"] == 8


def test_a_rebuild_that_cannot_be_had_keeps_the_current_cache(engine, reference, caplog):
    current = engine.experts
    with caplog.at_level("ERROR", logger="colibrid.engine.engine"):
        assert engine.rebuild_cache(_settings_of_size(4096)) is False  # smaller than one expert record
    assert engine.experts is current and engine.cache_status()["slots"] == 3
    assert "keeping the current cache" in caplog.text
    assert np.array_equal(engine.forward(PROMPT), reference)


def _settings_of_size(cache_bytes: int):
    from colibrid.engine.experts.cache import ExpertCacheSettings

    return ExpertCacheSettings(cache_size=cache_bytes, hugepages="off", lock_memory="off")


def test_the_loader_s_limits_reach_every_cache_the_engine_builds_later(engine, demo_pack):
    """A cache built after the thermal watch throttled the loader starts throttled too: a
    resize or a reopen must not lift a throttle."""
    from colibrid.engine.experts.source import ExpertLoadingPaused, LoadingLimits, LoadingPause

    pause = LoadingPause("thermal", "the NVMe drive is at 86 °C")
    engine.limit_loading(LoadingLimits(io_queue_depth=2, prefetch=False, pause=pause))
    assert (engine.experts.io_queue_depth, engine.experts.loading_pause) == (2, pause)
    assert engine.rebuild_cache(_settings(demo_pack, 4, io_queue_depth=16, prefetch=True))
    source = engine.experts
    assert (source.io_queue_depth, source.prefetch_enabled, source.loading_pause) == (2, False, pause)
    with pytest.raises(ExpertLoadingPaused):
        engine.forward(PROMPT)  # the new cache is empty and loading is paused
    engine.limit_loading(LoadingLimits(io_queue_depth=16, prefetch=True))
    assert (source.io_queue_depth, source.prefetch_enabled, source.loading_pause) == (16, True, None)
    engine.forward(PROMPT)


def test_the_loader_threads_start_on_their_cpus_and_the_caller_keeps_its_own(demo_pack):
    from colibrid.engine.experts.cache import CachedExpertSource
    from colibrid.pack.reader import Pack

    before = os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("needs two CPUs to tell the loader's from the caller's")
    one_cpu = frozenset([max(before)])
    threads_before = set(os.listdir("/proc/self/task"))
    source = CachedExpertSource.from_settings(Pack.open(demo_pack), _settings(demo_pack, 2, loader_cpus=one_cpu))
    try:
        assert os.sched_getaffinity(0) == before
        new_threads = set(os.listdir("/proc/self/task")) - threads_before  # the loader's I/O threads
        assert new_threads and all(os.sched_getaffinity(int(t)) == one_cpu for t in new_threads)
    finally:
        source.close()


def test_a_source_made_by_the_caller_is_used_as_it_is(demo_pack):
    from colibrid.engine.engine import Engine
    from colibrid.engine.experts.source import PreadExpertSource
    from colibrid.pack.reader import Pack

    pack = Pack.open(demo_pack)
    source = PreadExpertSource(pack)
    engine = Engine(pack, experts=source)
    assert engine.experts is source and engine.memory_budget() is None
    assert engine.cache_status()["kind"] == "pread"
    engine.set_cache_policy("lfru")  # nothing to follow it: not an error
    with pytest.raises(ValueError, match="made by its caller"):
        engine.rebuild_cache()
    with pytest.raises(ValueError, match="not both"):
        Engine(pack, experts=source, cache=_settings(demo_pack, 2))
    engine.close()
