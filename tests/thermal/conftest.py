"""Fixtures: a fake sysfs tree per test, and a real expert cache on a demo pack."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.thermal.fake_sysfs import FakeSysfs


@pytest.fixture
def sysfs(tmp_path) -> FakeSysfs:
    return FakeSysfs(tmp_path / "fake")


@pytest.fixture(scope="session")
def thermal_pack(tmp_path_factory) -> Path:
    """A random-weight OLMoE pack (numpy only, ~1 s): 4 MoE layers of 16 experts."""
    out = tmp_path_factory.mktemp("thermal-pack") / "demo.pack"
    subprocess.run([sys.executable, "-m", "colibrid.demo", str(out), "--force"], check=True,
                   capture_output=True, timeout=120)
    return out


@pytest.fixture
def expert_source(thermal_pack):
    """A CachedExpertSource with room for every expert, 16 reads in flight and prefetch on."""
    from colibrid.engine.expert_cache import CachedExpertSource
    from colibrid.pack.reader import Pack

    pack = Pack.open(thermal_pack)
    source = CachedExpertSource(pack, cache_bytes="64M", io_queue_depth=16, prefetch=True, hugepages="off",
                                lock_memory="off")
    yield source
    source.close()
