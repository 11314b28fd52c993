"""The machine's memory as the expert cache asks for it: the daemon's CacheMemory.

The engine's cache never measures memory or writes a sysctl itself; it asks a CacheMemory
(colibrid.engine.experts.backing, a Protocol this class meets without importing the engine)
and the daemon hands it this one, over colibrid.system.memory:

    budget()               MemAvailable and the cgroup memory limit, measured at each cache build
    may_raise_hugepages    root: only root may write vm.nr_hugepages
    reserve_hugepages()    reserve_hugepages(), pages raised written down in the hugepage record
    memlock_fix_hint()     RLIMIT_MEMLOCK, CAP_IPC_LOCK and the service unit's LimitMEMLOCK=
"""

from __future__ import annotations

import os
from pathlib import Path

from colibrid.system.memory import (DEFAULT_HUGEPAGE_RECORD, HugepageRecord, HugepageReservation, MemoryBudget,
                                    measure_budget, memlock_fix_hint, reserve_hugepages)


class MachineMemory:
    """This machine's memory for the expert cache.

    hugepage_record  the file where pages added to vm.nr_hugepages are written down, so the
                     next start gives them back if this process dies first (the config's
                     hugepage_record); None: nowhere.
    budget           the budget to size from; None (the daemon): measured at every cache build,
                     so a resize sees the memory as it is then.
    """

    def __init__(self, hugepage_record: Path | None = DEFAULT_HUGEPAGE_RECORD, budget: MemoryBudget | None = None) -> None:
        self.hugepage_record = Path(hugepage_record) if hugepage_record is not None else None
        self._budget = budget

    def __repr__(self) -> str:
        return f"MachineMemory(hugepage_record={self.hugepage_record!r}, budget={self._budget!r})"

    @property
    def may_raise_hugepages(self) -> bool:
        return os.geteuid() == 0

    def budget(self) -> MemoryBudget:
        return self._budget if self._budget is not None else measure_budget()

    def reserve_hugepages(self, region_bytes: int, raise_pool: bool, target_total: int | None = None) -> HugepageReservation:
        record = HugepageRecord(self.hugepage_record) if self.hugepage_record is not None else None
        return reserve_hugepages(region_bytes, raise_pool, target_total, record)

    def memlock_fix_hint(self, region_bytes: int, lock_errno: int) -> str:
        return memlock_fix_hint(region_bytes, lock_errno)
