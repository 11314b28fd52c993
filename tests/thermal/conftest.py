"""Fixtures: a fake sysfs tree per test, and a real expert cache on a demo pack."""

from __future__ import annotations

import pytest

from tests.thermal.fake_sysfs import FakeSysfs


@pytest.fixture
def sysfs(tmp_path) -> FakeSysfs:
    return FakeSysfs(tmp_path / "fake")


@pytest.fixture
def expert_source(demo_pack):
    """A CachedExpertSource with room for every expert, 16 reads in flight and prefetch on."""
    from colibrid.engine.experts.cache import CachedExpertSource
    from colibrid.pack.reader import Pack

    pack = Pack.open(demo_pack)
    source = CachedExpertSource(pack, cache_bytes="64M", io_queue_depth=16, prefetch=True, hugepages="off",
                                lock_memory="off")
    yield source
    source.close()
