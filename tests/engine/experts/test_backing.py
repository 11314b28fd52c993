"""What the expert cache asks of the machine goes through the CacheMemory it is handed: the
budget a percentage is of, hugetlb pages (raised or not), the memlock hint. Handed nothing,
the cache measures nothing, raises no hugetlb pages and writes no sysctl - it does not even
load the system layer."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
REPO = Path(__file__).resolve().parents[3]


def _slot_bytes(pack_path) -> int:
    from colibrid.engine.experts.slab import expert_slot_bytes
    from colibrid.pack.reader import Pack

    return expert_slot_bytes(Pack.open(pack_path).manifest)


def _pages() -> int | None:
    return int(NR_HUGEPAGES.read_text()) if NR_HUGEPAGES.exists() else None


# ---- the default: StatedMemory ---------------------------------------------------------------


_DEFAULT_SCRIPT = textwrap.dedent("""
    import sys
    from colibrid.engine.experts.cache import CachedExpertSource, ExpertCacheError
    from colibrid.pack.reader import Pack
    pack = Pack.open(sys.argv[1])
    with CachedExpertSource(pack, "2M", hugepages="auto", lock_memory="off") as source:
        info = source.backing_info()
        print("auto:", info["backing"], info["hugepages_added"], info["notes"][0])
    try:
        CachedExpertSource(pack, "2M", hugepages=int(sys.argv[2]), lock_memory="off")
    except ExpertCacheError as exc:
        print("count:", exc)
    print("system layer loaded:", sorted(m for m in sys.modules if m.startswith("colibrid.system")))
""")


def test_a_cache_handed_no_memory_raises_no_hugepages_and_never_loads_the_system_layer(demo_pack):
    before = _pages()
    proc = subprocess.run([sys.executable, "-c", _DEFAULT_SCRIPT, str(demo_pack), str((before or 0) + 4)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines())
    backing, added, note = lines["auto"].split(" ", 2)
    assert backing != "hugetlb" and added == "0"
    assert note.startswith("hugetlb pages not used: no hugetlb pages handed in to the expert cache")
    assert note.endswith("falling back to transparent hugepages")
    assert lines["count"].startswith(f"hugepages = {(before or 0) + 4}: no hugetlb pages handed in")
    assert lines["system layer loaded"] == "[]"
    assert _pages() == before  # nothing written to vm.nr_hugepages, as root too


def test_a_stated_budget_is_what_a_percentage_is_of(demo_pack):
    from colibrid.engine.experts.backing import StatedMemory
    from colibrid.engine.experts.cache import CachedExpertSource
    from colibrid.pack.reader import Pack

    slot = _slot_bytes(demo_pack)
    with CachedExpertSource(Pack.open(demo_pack), "50%", hugepages="off", lock_memory="off",
                            memory=StatedMemory(8 * slot)) as source:
        assert source.n_slots == 4
        status = source.budget_status()
    assert (status["available_bytes"], status["basis"]) == (8 * slot, "stated by the caller")
    assert (status["cache_size"], status["cache_bytes"]) == ("50%", 4 * slot)
    assert status["cgroup_limit_bytes"] is None


def test_without_a_budget_a_percentage_is_refused_and_a_size_is_never_too_big(demo_pack):
    from colibrid.engine.experts.cache import CachedExpertSource, ExpertCacheError
    from colibrid.pack.reader import Pack

    pack = Pack.open(demo_pack)
    with pytest.raises(ExpertCacheError, match="cache_size = 50% is a share of the memory budget"):
        CachedExpertSource(pack, "50%", hugepages="off", lock_memory="off")
    with CachedExpertSource(pack, 3 * _slot_bytes(demo_pack), hugepages="off", lock_memory="off") as source:
        assert source.n_slots == 3 and source.backing_info()["notes"] == []
        assert source.budget_status()["available_bytes"] is None


# ---- what the cache asks: a recording CacheMemory ---------------------------------------------


@dataclass
class _Budget:
    available_bytes: int = 1 << 30
    limit_ignores_hugetlb: bool = False
    basis: str = "a test's"

    def describe(self) -> str:
        return f"memory budget ({self.basis})"

    def status(self) -> dict:
        return {"available_bytes": self.available_bytes, "basis": self.basis}


@dataclass
class _Grant:
    available: bool
    message: str = "the test's pages"
    pages_added: int = 0
    released: int = 0

    def release(self) -> None:
        self.released += 1
        self.pages_added = 0


@dataclass
class _RecordingMemory:
    """A CacheMemory that writes nothing and remembers what it was asked."""

    may_raise_hugepages: bool = True
    budget_given: _Budget = field(default_factory=_Budget)
    grant_available: bool = True
    asked: list = field(default_factory=list)  # (region_bytes, raise_pool, target_total) per reservation
    budgets_measured: int = 0
    grants: list = field(default_factory=list)

    def budget(self) -> _Budget:
        self.budgets_measured += 1
        return self.budget_given

    def reserve_hugepages(self, region_bytes: int, raise_pool: bool, target_total: int | None = None) -> _Grant:
        self.asked.append((region_bytes, raise_pool, target_total))
        grant = _Grant(self.grant_available, pages_added=3 if raise_pool and self.grant_available else 0)
        self.grants.append(grant)
        return grant

    def memlock_fix_hint(self, region_bytes: int, lock_errno: int) -> str:
        return "the test's hint"


def test_the_recording_memory_is_a_cache_memory_and_so_are_the_shipped_ones():
    from colibrid.engine.experts.backing import CacheMemory, StatedMemory
    from colibrid.system.cache_memory import MachineMemory

    for memory in (_RecordingMemory(), StatedMemory(), MachineMemory(None)):
        assert isinstance(memory, CacheMemory)


def test_auto_asks_to_raise_the_pool_when_it_may_and_gives_the_pages_back_on_close(demo_pack):
    from colibrid.engine.experts.cache import CachedExpertSource
    from colibrid.pack.reader import Pack

    slot = _slot_bytes(demo_pack)
    memory = _RecordingMemory()
    source = CachedExpertSource(Pack.open(demo_pack), 2 * slot, hugepages="auto", lock_memory="off", memory=memory)
    try:
        assert memory.asked == [(2 * slot, True, None)]
        info = source.backing_info()
        assert (info["hugepages_added"], info["hugepages_message"]) == (3, "the test's pages")
    finally:
        source.close()
    assert memory.grants[0].released == 1


@pytest.mark.parametrize("may_raise, under_limit, raise_pool, says_why", [
    (True, True, False, True),  # root under a limit that does not count hugetlb pages: not raised, and why
    (False, False, False, False),  # not root: only free pages, nothing to add
])
def test_auto_does_not_raise_the_pool_when_it_may_not(demo_pack, may_raise, under_limit, raise_pool, says_why):
    from colibrid.engine.experts.cache import CachedExpertSource
    from colibrid.pack.reader import Pack

    memory = _RecordingMemory(may_raise_hugepages=may_raise, budget_given=_Budget(limit_ignores_hugetlb=under_limit),
                              grant_available=False)
    with CachedExpertSource(Pack.open(demo_pack), "2M", hugepages="auto", lock_memory="off", memory=memory) as source:
        info = source.backing_info()
    assert [raised for _, raised, _ in memory.asked] == [raise_pool]
    assert info["backing"] != "hugetlb" and info["hugepages_message"] is None
    (note,) = [n for n in info["notes"] if n.startswith("hugetlb pages not used")]
    assert ("not raised under a cgroup memory limit" in note) == says_why
    assert memory.grants[0].released == 1


def test_a_page_count_asks_for_that_pool_and_fails_with_the_memory_s_message(demo_pack):
    from colibrid.engine.experts.cache import CachedExpertSource, ExpertCacheError
    from colibrid.pack.reader import Pack

    memory = _RecordingMemory(grant_available=False)
    with pytest.raises(ExpertCacheError, match="hugepages = 40: the test's pages"):
        CachedExpertSource(Pack.open(demo_pack), "2M", hugepages=40, lock_memory="off", memory=memory)
    assert [(raised, target) for _, raised, target in memory.asked] == [(True, 40)]
    assert memory.grants[0].released == 1


def test_the_budget_is_asked_once_per_cache_and_sizes_it(demo_pack):
    from colibrid.engine.experts.cache import CachedExpertSource
    from colibrid.pack.reader import Pack

    slot = _slot_bytes(demo_pack)
    memory = _RecordingMemory(budget_given=_Budget(available_bytes=2 * slot, basis="two slots"))
    with CachedExpertSource(Pack.open(demo_pack), 4 * slot, hugepages="off", lock_memory="off",
                            memory=memory) as source:
        (note,) = [n for n in source.backing_info()["notes"] if "above the memory available" in n]
    assert "two slots" in note and memory.asked == []  # hugepages = "off": no reservation asked for
    assert memory.budgets_measured == 1
