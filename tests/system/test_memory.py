"""colibrid.system.memory: percentages are of the memory budget (MemAvailable, or the room under the
cgroup limit when smaller), and the hugepage record that lets the next colibrid give back the
pages of one that was killed; and the expert cache's MachineMemory over them.
vm.nr_hugepages and /proc/meminfo are fake files here."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from colibrid.system import memory
from colibrid.system.cache_memory import MachineMemory
from colibrid.system.cgroup_memory import CgroupLimit
from colibrid.system.memory import HugepageRecord, MemoryBudget, parse_size, reserve_hugepages, return_orphaned_hugepages

MiB = 1 << 20


def _limit(limit_bytes: int, usage_bytes: int, counts_hugetlb: bool = False) -> CgroupLimit:
    return CgroupLimit(1, "/colibri", "memory.limit_in_bytes", limit_bytes, usage_bytes, counts_hugetlb)


# ---- the budget --------------------------------------------------------------------------------


def test_without_a_cgroup_limit_the_budget_is_mem_available():
    budget = MemoryBudget(8192 * MiB, None)
    assert (budget.available_bytes, budget.basis, budget.limited_by_cgroup) == (8192 * MiB, "MemAvailable", False)
    assert budget.status()["cgroup_limit_bytes"] is None


def test_a_cgroup_limit_with_less_room_than_mem_available_is_the_budget():
    budget = MemoryBudget(8192 * MiB, _limit(1024 * MiB, 256 * MiB))
    assert budget.available_bytes == 768 * MiB
    assert budget.basis.startswith("cgroup v1 /colibri: memory.limit_in_bytes 1.0 GiB, 256.0 MiB in use")
    assert budget.status()["cgroup_limit_bytes"] == 1024 * MiB


def test_a_cgroup_limit_above_mem_available_leaves_mem_available():
    budget = MemoryBudget(512 * MiB, _limit(4096 * MiB, 100 * MiB))
    assert (budget.available_bytes, budget.basis) == (512 * MiB, "MemAvailable")


def test_status_says_how_hugetlb_pages_count():
    assert "not charged to the cgroup v1 memory limit" in MemoryBudget(1, _limit(2, 0)).hugetlb_treatment()
    assert "charged to the cgroup memory limit" in MemoryBudget(1, _limit(2, 0, counts_hugetlb=True)).hugetlb_treatment()


def test_a_limit_that_does_not_count_hugetlb_pages_is_named_for_the_cache():
    assert MemoryBudget(1, _limit(2, 0)).limit_ignores_hugetlb
    assert not MemoryBudget(1, _limit(2, 0, counts_hugetlb=True)).limit_ignores_hugetlb
    assert not MemoryBudget(1, None).limit_ignores_hugetlb


def test_a_percentage_is_of_the_budget_when_none_is_given(tmp_path, monkeypatch):
    (tmp_path / "meminfo").write_text("MemTotal: 16777216 kB\nMemAvailable: 8388608 kB\n")
    monkeypatch.setattr(memory, "MEMINFO", tmp_path / "meminfo")
    monkeypatch.setattr(memory.cgroup_memory, "memory_limit", lambda root=None: _limit(1024 * MiB, 24 * MiB))
    assert parse_size("50%", "cache_size") == 500 * MiB
    monkeypatch.setattr(memory.cgroup_memory, "memory_limit", lambda root=None: None)
    assert parse_size("50%", "cache_size") == 4096 * MiB


# ---- the hugepage record ----------------------------------------------------------------------


class FakeHugepages:
    """vm.nr_hugepages and the HugePages_* lines of /proc/meminfo, kept consistent as the
    kernel keeps them: writing the sysctl adds or removes free pages."""

    def __init__(self, directory: Path, monkeypatch, total: int, free: int, reserved: int = 0) -> None:
        self.meminfo = directory / "meminfo"
        self.total, self.free, self.reserved = total, free, reserved
        monkeypatch.setattr(memory, "NR_HUGEPAGES", self)
        monkeypatch.setattr(memory, "MEMINFO", self.meminfo)
        self._write_meminfo()

    def read_text(self) -> str:  # as Path.read_text of /proc/sys/vm/nr_hugepages
        return f"{self.total}\n"

    def write_text(self, text: str) -> None:
        wanted = int(text)
        self.free = max(0, self.free + wanted - self.total)  # (pages in use never go away)
        self.total = wanted
        self._write_meminfo()

    def _write_meminfo(self) -> None:
        self.meminfo.write_text(f"MemAvailable: 8388608 kB\nHugePages_Total: {self.total}\nHugePages_Free: "
                                f"{self.free}\nHugePages_Rsvd: {self.reserved}\nHugepagesize: 2048 kB\n")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _record_of(path: Path) -> list[dict]:
    return json.loads(path.read_text())["raised"] if path.exists() else []


def _write_record(path: Path, entries: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"raised": entries}))


def test_raising_the_pool_is_written_down_and_releasing_it_clears_the_record(tmp_path, monkeypatch):
    pages = FakeHugepages(tmp_path, monkeypatch, total=4, free=4)
    record_path = tmp_path / "run" / "hugepages.json"
    res = reserve_hugepages(10 * 2 * MiB, raise_pool=True, record=HugepageRecord(record_path))
    assert (res.pages_added, pages.total) == (6, 10)
    (entry,) = _record_of(record_path)
    assert (entry["pid"], entry["pages"]) == (os.getpid(), 6)
    res.release()
    assert pages.total == 4 and not record_path.exists()


def test_pages_of_a_killed_colibrid_are_given_back_at_the_next_start(tmp_path, monkeypatch):
    pages = FakeHugepages(tmp_path, monkeypatch, total=10, free=10)  # the killed one's pages are free again
    record_path = tmp_path / "hugepages.json"
    _write_record(record_path, [{"pid": _dead_pid(), "started": 1, "pages": 6}])
    assert return_orphaned_hugepages(HugepageRecord(record_path)) == 6
    assert pages.total == 4 and not record_path.exists()


def test_pages_of_a_running_colibrid_are_left_alone(tmp_path, monkeypatch):
    pages = FakeHugepages(tmp_path, monkeypatch, total=10, free=0)
    record_path = tmp_path / "hugepages.json"
    alive = [{"pid": os.getpid(), "started": memory._start_ticks(os.getpid()), "pages": 6}]
    _write_record(record_path, alive)
    assert return_orphaned_hugepages(HugepageRecord(record_path)) == 0
    assert pages.total == 10 and _record_of(record_path) == alive


def test_a_reused_pid_is_not_mistaken_for_the_colibrid_that_raised_the_pool(tmp_path, monkeypatch):
    pages = FakeHugepages(tmp_path, monkeypatch, total=10, free=10)
    record_path = tmp_path / "hugepages.json"
    other_start = memory._start_ticks(os.getpid()) + 1  # our pid, but not our start time
    _write_record(record_path, [{"pid": os.getpid(), "started": other_start, "pages": 6}])
    assert return_orphaned_hugepages(HugepageRecord(record_path)) == 6
    assert pages.total == 4


def test_pages_now_in_use_by_others_are_not_taken(tmp_path, monkeypatch):
    # 10 pages, 3 free of which 1 is reserved by a mapping: only 2 can go.
    pages = FakeHugepages(tmp_path, monkeypatch, total=10, free=3, reserved=1)
    record_path = tmp_path / "hugepages.json"
    _write_record(record_path, [{"pid": _dead_pid(), "started": 1, "pages": 6}])
    assert return_orphaned_hugepages(HugepageRecord(record_path)) == 2
    assert pages.total == 8 and not record_path.exists()


def test_reserving_gives_back_orphaned_pages_first(tmp_path, monkeypatch):
    pages = FakeHugepages(tmp_path, monkeypatch, total=10, free=10)
    record_path = tmp_path / "hugepages.json"
    _write_record(record_path, [{"pid": _dead_pid(), "started": 1, "pages": 6}])
    res = reserve_hugepages(6 * 2 * MiB, raise_pool=True, record=HugepageRecord(record_path))
    # 10 -> 4 (the dead one's six back), then 4 -> 6 for this cache: only our 2 are written down.
    assert (pages.total, res.pages_added, res.available) == (6, 2, True)
    assert [e["pages"] for e in _record_of(record_path)] == [2]


def test_a_symlink_planted_as_the_record_is_neither_followed_nor_trusted(tmp_path, monkeypatch):
    pages = FakeHugepages(tmp_path, monkeypatch, total=10, free=10)
    target = tmp_path / "elsewhere.json"
    _write_record(target, [{"pid": _dead_pid(), "started": 1, "pages": 6}])
    record_path = tmp_path / "run" / "hugepages.json"
    record_path.parent.mkdir()
    record_path.symlink_to(target)
    record = HugepageRecord(record_path)
    assert return_orphaned_hugepages(record) == 0
    with record.locked():
        record.add(3)
    assert record_path.is_file() and not record_path.is_symlink()  # replaced, not written through
    assert _record_of(target)[0]["pages"] == 6 and pages.total == 10


@pytest.mark.skipif(os.geteuid() != 0, reason="giving the record to another user needs root")
def test_a_record_owned_by_another_user_is_not_trusted(tmp_path, monkeypatch):
    pages = FakeHugepages(tmp_path, monkeypatch, total=10, free=10)
    record_path = tmp_path / "hugepages.json"
    _write_record(record_path, [{"pid": _dead_pid(), "started": 1, "pages": 6}])
    os.chown(record_path, 65534, 65534)
    assert return_orphaned_hugepages(HugepageRecord(record_path)) == 0
    assert pages.total == 10


@pytest.mark.parametrize("text", ["not json", '{"raised": [{"pid": "1", "started": 1, "pages": 6}]}',
                                  '{"raised": [{"pid": 1, "started": 1, "pages": -6}]}', '[]'])
def test_a_damaged_record_is_ignored(tmp_path, monkeypatch, text):
    pages = FakeHugepages(tmp_path, monkeypatch, total=10, free=10)
    record_path = tmp_path / "hugepages.json"
    record_path.write_text(text)
    assert return_orphaned_hugepages(HugepageRecord(record_path)) == 0
    assert pages.total == 10


def test_an_unusable_record_directory_changes_nothing(tmp_path, monkeypatch):
    pages = FakeHugepages(tmp_path, monkeypatch, total=4, free=4)
    (tmp_path / "file").write_text("")
    record = HugepageRecord(tmp_path / "file" / "hugepages.json")  # its directory cannot exist
    res = reserve_hugepages(6 * 2 * MiB, raise_pool=True, record=record)
    assert res.pages_added == 2 and pages.total == 6
    res.release()
    assert pages.total == 4


def test_looking_for_orphans_creates_nothing(tmp_path, monkeypatch):
    FakeHugepages(tmp_path, monkeypatch, total=4, free=4)
    assert return_orphaned_hugepages(HugepageRecord(tmp_path / "run" / "colibri" / "hugepages.json")) == 0
    assert not (tmp_path / "run").exists()


# ---- the expert cache's memory: MachineMemory ---------------------------------------------------


def test_the_machine_memory_measures_the_budget_at_every_cache_build_unless_given_one(tmp_path, monkeypatch):
    (tmp_path / "meminfo").write_text("MemAvailable: 8388608 kB\n")
    monkeypatch.setattr(memory, "MEMINFO", tmp_path / "meminfo")
    monkeypatch.setattr(memory.cgroup_memory, "memory_limit", lambda root=None: None)
    machine = MachineMemory(None)
    assert machine.budget() == MemoryBudget(8192 * MiB, None)
    (tmp_path / "meminfo").write_text("MemAvailable: 4194304 kB\n")
    assert machine.budget().available_bytes == 4096 * MiB  # measured again: a resize sees memory as it is
    given = MemoryBudget(1024 * MiB, _limit(4096 * MiB, 0))
    assert MachineMemory(None, given).budget() is given


def test_the_machine_memory_raises_the_pool_and_writes_it_down_in_its_record(tmp_path, monkeypatch):
    pages = FakeHugepages(tmp_path, monkeypatch, total=4, free=4)
    record_path = tmp_path / "run" / "hugepages.json"
    grant = MachineMemory(record_path).reserve_hugepages(10 * 2 * MiB, raise_pool=True)
    assert (grant.available, grant.pages_added, pages.total) == (True, 6, 10)
    assert [entry["pages"] for entry in _record_of(record_path)] == [6]
    grant.release()
    assert pages.total == 4 and not record_path.exists()
    target = MachineMemory(None).reserve_hugepages(2 * 2 * MiB, raise_pool=True, target_total=12)
    assert (target.pages_added, pages.total) == (8, 12)  # hugepages = 12: the pool to at least 12
    target.release()
    assert pages.total == 4


def test_the_machine_memory_raises_nothing_when_not_asked_to(tmp_path, monkeypatch):
    pages = FakeHugepages(tmp_path, monkeypatch, total=4, free=2)
    grant = MachineMemory(tmp_path / "hugepages.json").reserve_hugepages(10 * 2 * MiB, raise_pool=False)
    assert (grant.available, grant.pages_added, pages.total) == (False, 0, 4)
    assert grant.message == "10 hugetlb pages needed, 2 free (vm.nr_hugepages = 4)"
    assert not (tmp_path / "hugepages.json").exists()


def test_only_root_may_raise_the_pool_and_the_memlock_hint_is_the_daemon_s(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert MachineMemory(None).may_raise_hugepages is False
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert MachineMemory(None).may_raise_hugepages is True
    assert MachineMemory(None).memlock_fix_hint(1 << 30, errno.EPERM) == memory.memlock_fix_hint(1 << 30, errno.EPERM)
    assert "LimitMEMLOCK" in MachineMemory(None).memlock_fix_hint(1 << 30, errno.EPERM)
