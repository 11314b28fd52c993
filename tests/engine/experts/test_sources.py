"""ExpertSource is one contract that every source keeps - the plain pread source and the AEPC
cache alike - so the MoE block, the engine and the thermal watch use any source without
asking it what it can do."""

from __future__ import annotations

import numpy as np
import pytest

# Every member a caller uses: the MoE block (acquire, prefetch, max_pinned, prefetch_enabled),
# the engine (get, summary, close, return_hugepages), the thermal watch (the loader's settings).
CALLERS_USE = {"acquire", "get", "prefetch", "summary", "max_pinned", "prefetch_enabled", "io_queue_depth",
               "loading_pause", "set_io_queue_depth", "set_prefetch", "set_loading_paused", "return_hugepages",
               "close"}


@pytest.fixture(params=["pread", "aepc"])
def source(request, demo_pack):
    from colibrid.engine.experts.cache import CachedExpertSource
    from colibrid.engine.experts.source import PreadExpertSource
    from colibrid.pack.reader import Pack

    pack = Pack.open(demo_pack)
    if request.param == "pread":
        made = PreadExpertSource(pack)
    else:
        made = CachedExpertSource(pack, "64M", hugepages="off", lock_memory="off", prefetch=False)
    yield made
    made.close()


def test_the_contract_declares_every_member_its_callers_use():
    from colibrid.engine.experts.source import ExpertSource

    assert CALLERS_USE <= ExpertSource.__abstractmethods__


def test_a_source_that_leaves_out_a_member_cannot_be_made(demo_pack):
    from colibrid.engine.experts.source import PlainExpertSource
    from colibrid.pack.reader import Pack

    class WithoutSummary(PlainExpertSource):
        def get(self, layer, expert):
            raise AssertionError("never called")

    with pytest.raises(TypeError, match="summary"):
        WithoutSummary(Pack.open(demo_pack))


def test_acquire_yields_every_expert_asked_for_with_the_bytes_get_reads(source):
    from colibrid.engine.experts.source import AcquiredExperts, ExpertSource

    assert isinstance(source, ExpertSource) and source.max_pinned >= 4
    with source.acquire(1, [2, 5, 9]) as weights:
        assert isinstance(weights, AcquiredExperts) and sorted(weights) == [2, 5, 9] and len(weights) == 3
        for expert in (2, 5, 9):
            got = weights[expert]
            assert weights.is_ready(expert) is True  # looked up: loaded
            again = source.get(1, expert)
            for part in ("gate", "up", "down"):
                assert np.array_equal(np.asarray(getattr(got, part).data), np.asarray(getattr(again, part).data))
    summary = source.summary()
    assert {"kind", "hits", "misses", "bytes_read"} <= set(summary) and summary["misses"] >= 3


def test_prefetch_reads_nothing_while_it_is_off(source):
    source.set_prefetch(False)
    assert source.prefetch_enabled is False
    assert source.prefetch(2, [1, 2, 3]) == 0
    source.set_io_queue_depth(4)  # accepted by every source (a no-op where there is no queue)
    assert source.io_queue_depth in (1, 4)


def test_while_loading_is_paused_a_read_fails_with_the_pause_s_code_and_resumes_after(source):
    from colibrid.engine.experts.source import ExpertLoadingPaused, LoadingLimits, LoadingPause, apply_loading_limits

    pause = LoadingPause("thermal", "the NVMe drive is at 86 °C")
    apply_loading_limits(source, LoadingLimits(io_queue_depth=2, prefetch=False, pause=pause))
    assert source.loading_pause == pause
    with pytest.raises(ExpertLoadingPaused) as refused:
        source.get(3, 7)  # never read: not in memory
    assert refused.value.code == "thermal" and (refused.value.layer, refused.value.expert) == (3, 7)
    apply_loading_limits(source, LoadingLimits(io_queue_depth=2, prefetch=False, pause=None))
    assert source.loading_pause is None
    source.get(3, 7)


def test_close_twice_and_return_hugepages_are_safe(source):
    source.return_hugepages()
    source.close()
    source.close()
