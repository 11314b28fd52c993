"""What the expert cache asks of the machine's memory, handed in by whoever builds the cache.

The cache sizes its slab from a memory budget, may back it with hugetlb pages and locks it.
How much memory there is (MemAvailable, a cgroup limit), whether the pool of hugetlb pages may
be raised (a write to vm.nr_hugepages, given back later) and how to lift a memlock limit are
the machine's business, not the engine's: the cache asks through a CacheMemory and never
measures, writes a sysctl or reads the daemon's config itself.

    CacheMemory      budget(), may_raise_hugepages, reserve_hugepages(), memlock_fix_hint()
    CacheBudget      what budget() returns: the bytes a percentage cache_size is of
    HugepageGrant    what reserve_hugepages() returns: whether the pages are there; release()

The daemon hands in colibrid.system.cache_memory.MachineMemory (measured budget, pages raised
as root and written down in the hugepage record). A caller that hands nothing in gets
StatedMemory: a budget given as a number, or none, and no hugetlb pages; it needs no
privileges and changes nothing on the machine.

These are Protocols, not base classes: the system layer implements them without importing
the engine (the two layers sit side by side and neither imports the other).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from colibrid.sizes import format_bytes


class CacheBudget(Protocol):
    """The memory a percentage cache_size is of, measured (or stated) once per cache build."""

    @property
    def available_bytes(self) -> int | None:
        """The bytes a percentage is of; None when unknown (then a percentage cannot be had and
        no absolute size counts as too big)."""
        ...

    @property
    def basis(self) -> str:
        """What the number is, for logs and status: "MemAvailable", a cgroup limit with its figures, ..."""
        ...

    @property
    def limit_ignores_hugetlb(self) -> bool:
        """A memory limit applies that does not count hugetlb pages: raising the pool for the
        cache would take memory from outside that limit."""
        ...

    def describe(self) -> str:
        """One phrase for logs: "memory budget 12.0 GiB (MemAvailable)"."""
        ...

    def status(self) -> dict:
        """status' memory_budget (docs/protocol.md): available_bytes, basis, mem_available_bytes,
        cgroup_limit_bytes, cgroup_usage_bytes, hugetlb."""
        ...


class HugepageGrant(Protocol):
    """The hugetlb pages set aside for one slab: whether they are free now, and what was done
    to get them; release() gives back the pages raised for it (safe while the slab is mapped)."""

    available: bool  # enough free 2 MiB hugetlb pages for the region now
    message: str  # one line for logs and status, saying what was done or why not
    pages_added: int  # pages this grant raised the pool by (0 after release())

    def release(self) -> None: ...


@runtime_checkable
class CacheMemory(Protocol):
    """The machine's memory, as the expert cache asks for it."""

    @property
    def may_raise_hugepages(self) -> bool:
        """Whether this process may raise the pool of hugetlb pages at all (root, for the daemon)."""
        ...

    def budget(self) -> CacheBudget:
        """The memory budget now; called once for each cache built."""
        ...

    def reserve_hugepages(self, region_bytes: int, raise_pool: bool, target_total: int | None = None) -> HugepageGrant:
        """Makes sure ``region_bytes`` of 2 MiB hugetlb pages are free, raising the pool when
        ``raise_pool``; ``target_total``: raise the pool to at least this many pages instead."""
        ...

    def memlock_fix_hint(self, region_bytes: int, lock_errno: int) -> str:
        """How to let this process lock ``region_bytes``, for the message after mlock failed."""
        ...


# --------------------------------------------------------------------------------------------
# The default: stated, not measured; nothing raised
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StatedBudget:
    """A budget the caller states as a number of bytes (None: none stated)."""

    available_bytes: int | None = None

    @property
    def basis(self) -> str:
        return "stated by the caller" if self.available_bytes is not None else "none stated: nothing was measured"

    @property
    def limit_ignores_hugetlb(self) -> bool:
        return False  # no limit is known

    def describe(self) -> str:
        if self.available_bytes is None:
            return f"memory budget ({self.basis})"
        return f"memory budget {format_bytes(self.available_bytes)} ({self.basis})"

    def status(self) -> dict:
        return {"available_bytes": self.available_bytes, "basis": self.basis, "mem_available_bytes": None,
                "cgroup_limit_bytes": None, "cgroup_usage_bytes": None,
                "hugetlb": "no hugetlb pages handed in to the expert cache"}


@dataclass
class NoHugepages:
    """The grant of a memory that hands out no hugetlb pages: never available, nothing to give back."""

    message: str
    available: bool = False
    pages_added: int = 0

    def release(self) -> None:
        pass


@dataclass(frozen=True)
class StatedMemory:
    """The CacheMemory of a caller that hands none in (tests, benches, tools): the budget is
    ``available_bytes`` as stated (None: a percentage cache_size is refused), no hugetlb pages
    are reserved or raised, nothing is measured and nothing on the machine is written."""

    available_bytes: int | None = None

    @property
    def may_raise_hugepages(self) -> bool:
        return False

    def budget(self) -> StatedBudget:
        return StatedBudget(self.available_bytes)

    def reserve_hugepages(self, region_bytes: int, raise_pool: bool, target_total: int | None = None) -> NoHugepages:
        return NoHugepages(f"no hugetlb pages handed in to the expert cache ({-(-region_bytes // (2 << 20))} "
                           "pages of 2 MiB needed)")

    def memlock_fix_hint(self, region_bytes: int, lock_errno: int) -> str:
        reason = os.strerror(lock_errno) if lock_errno else "refused"
        return (f"mlock of {format_bytes(region_bytes)} failed ({reason}): raise RLIMIT_MEMLOCK "
                "(`ulimit -l unlimited`) or grant CAP_IPC_LOCK; or lower cache_size; or set lock_memory = \"try\"")
