"""The expert cache's slab: how many slots it has, and what backs them.

One region of S slots, each holding one expert record padded to whole pages. Its size comes
from cache_size (bytes, or a percentage of the memory budget); its backing from hugepages
("auto", "thp", "off" or a page count) and lock_memory, as far as the machine allows - asked
through the CacheMemory the cache was handed (colibrid.engine.experts.backing). Every
fallback taken is logged as a warning and added to ``notes``, which status shows.
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass

from colibrid import native
from colibrid.engine.experts.backing import CacheBudget, CacheMemory, HugepageGrant
from colibrid.sizes import format_bytes, is_percentage, size_in_bytes

log = logging.getLogger(__name__)

PAGE_BYTES = 4096
LOCK_MODES = {"off": native.AepcMode.OFF, "try": native.AepcMode.TRY, "required": native.AepcMode.REQUIRED}
BACKING_NAMES = {native.SlabBacking.PAGES: "pages", native.SlabBacking.THP: "thp", native.SlabBacking.HUGETLB: "hugetlb"}


class ExpertCacheError(Exception):
    """The expert cache cannot be set up as configured; the message says how to fix it."""


def expert_slot_bytes(manifest) -> int:
    """One cache slot: the pack's largest expert record, in whole pages (the reads are O_DIRECT)."""
    return -(-max(r.length for r in manifest.expert_records) // PAGE_BYTES) * PAGE_BYTES


def errno_name(e: int) -> str | None:
    """"ENOMEM" for errno.ENOMEM; None for 0 (no error)."""
    return errno.errorcode.get(e, str(e)) if e else None


def count_slots(cache_size: int | str, slot_bytes: int, n_records: int, budget: CacheBudget) -> int:
    """The slots ``cache_size`` holds (a percentage is of ``budget``): rounded down to whole
    slots, at least one, at most one per expert record."""
    if is_percentage(cache_size) and budget.available_bytes is None:
        raise ExpertCacheError(f"cache_size = {cache_size} is a share of the memory budget, and this cache was "
                               "handed none: give a size in bytes, or a CacheMemory that measures the budget")
    requested_bytes = size_in_bytes(cache_size, "cache_size", budget.available_bytes)
    n_slots = requested_bytes // slot_bytes
    if n_slots < 1:
        raise ExpertCacheError(
            f"cache_size {format_bytes(requested_bytes)} is smaller than one expert record "
            f"({format_bytes(slot_bytes)}): raise cache_size to at least {slot_bytes} bytes")
    if n_slots > n_records:
        log.info("cache_size holds %d slots, the pack has %d experts: using %d", n_slots, n_records, n_records)
        n_slots = n_records
    return int(n_slots)


def check_budget(cache_size: int | str, region_bytes: int, budget: CacheBudget, notes: list[str]) -> None:
    """Says which memory a percentage was of, and warns when the cache alone is bigger than
    the memory there is: the kernel would take it back with the OOM killer."""
    log.info("cache_size = %s: %s of the %s", cache_size, format_bytes(region_bytes), budget.describe())
    if budget.available_bytes is not None and region_bytes > budget.available_bytes:
        note = (f"cache_size = {cache_size} ({format_bytes(region_bytes)}) is above the memory available "
                f"({format_bytes(budget.available_bytes)}, {budget.basis}): "
                "colibrid may be OOM-killed; lower cache_size or use a percentage")
        log.warning("%s", note)
        notes.append(note)


@dataclass(frozen=True)
class HugepagePlan:
    """How the slab is to be mapped, and the hugetlb pages set aside for it."""

    hugetlb: native.AepcMode  # MAP_HUGETLB: off, try (fall back), required
    thp: native.AepcMode  # madvise(MADV_HUGEPAGE) when not hugetlb-backed
    grant: HugepageGrant | None = None  # release() gives back the pages raised for the slab


def plan_hugepages(hugepages: str | int, region_bytes: int, memory: CacheMemory, budget: CacheBudget,
                   notes: list[str]) -> HugepagePlan:
    """The backing ``hugepages`` asks for, as far as ``memory`` grants hugetlb pages:

    "auto"  hugetlb pages, raising the pool when ``memory`` may and no memory limit that does
            not count them applies (else only pages already free are used); without them
            transparent hugepages (a note says why)
    "thp"   transparent hugepages, else ordinary pages
    "off"   ordinary pages
    N       raise the pool to at least N pages and require hugetlb pages (ExpertCacheError if not)
    """
    if hugepages == "off":
        return HugepagePlan(native.AepcMode.OFF, native.AepcMode.OFF)
    if hugepages == "thp":
        return HugepagePlan(native.AepcMode.OFF, native.AepcMode.TRY)
    if hugepages == "auto":
        # Under a cgroup memory limit, raising the pool would take memory from outside the
        # limit, which does not count hugetlb pages: only pages already free are used.
        under_limit = budget.limit_ignores_hugetlb
        privileged = memory.may_raise_hugepages
        grant = memory.reserve_hugepages(region_bytes, raise_pool=privileged and not under_limit)
        if not grant.available:
            why = grant.message
            if under_limit and privileged:
                why += ("; not raised under a cgroup memory limit, which would not count them "
                        "(hugepages = N raises it anyway)")
            note = f"hugetlb pages not used: {why}; falling back to transparent hugepages"
            log.warning("%s", note)
            notes.append(note)
            grant.release()
            return HugepagePlan(native.AepcMode.OFF, native.AepcMode.TRY)
        return HugepagePlan(native.AepcMode.TRY, native.AepcMode.TRY, grant)
    if isinstance(hugepages, int) and not isinstance(hugepages, bool) and hugepages >= 0:
        grant = memory.reserve_hugepages(region_bytes, raise_pool=True, target_total=hugepages)
        if not grant.available:
            grant.release()
            raise ExpertCacheError(f"hugepages = {hugepages}: {grant.message}")
        return HugepagePlan(native.AepcMode.REQUIRED, native.AepcMode.OFF, grant)
    raise ExpertCacheError(f"hugepages {hugepages!r} is unknown; use \"auto\", \"thp\", \"off\" or a page count")


def map_slab(slot_bytes: int, n_slots: int, plan: HugepagePlan, hugepages: str | int, lock_memory: str,
             memory: CacheMemory, notes: list[str]) -> native.Slab:
    """The slab of ``n_slots`` slots, mapped as ``plan`` says and locked as ``lock_memory``
    says; a failure the settings require to succeed is an ExpertCacheError with the fix."""
    region_bytes = n_slots * slot_bytes
    try:
        slab = native.Slab(slot_bytes, n_slots, hugetlb=plan.hugetlb, thp=plan.thp, lock=LOCK_MODES[lock_memory])
    except native.SystemResourceError as exc:
        info = exc.info or {}
        if info.get("lock_errno"):
            hint = memory.memlock_fix_hint(region_bytes, info["lock_errno"])
            raise ExpertCacheError(f"lock_memory = \"required\": {hint}") from None
        if info.get("hugetlb_errno"):
            raise ExpertCacheError(
                f"hugepages = {hugepages}: mmap of {format_bytes(region_bytes)} of hugetlb pages failed "
                f"({os.strerror(info['hugetlb_errno'])}): raise vm.nr_hugepages (`sysctl vm.nr_hugepages=N`) "
                "or set hugepages = \"auto\"") from None
        raise ExpertCacheError(f"expert cache of {format_bytes(region_bytes)}: {exc}") from None
    except native.OutOfMemoryError as exc:
        raise ExpertCacheError(f"cannot map {format_bytes(region_bytes)} for the expert cache: {exc}; "
                               "lower cache_size") from None
    info = slab.info()
    if info["hugetlb_errno"]:
        note = f"MAP_HUGETLB failed ({errno_name(info['hugetlb_errno'])}): using {BACKING_NAMES[info['backing']]}"
        log.warning("%s", note)
        notes.append(note)
    if info["thp_errno"]:
        note = f"madvise(MADV_HUGEPAGE) failed ({errno_name(info['thp_errno'])}): ordinary pages"
        log.warning("%s", note)
        notes.append(note)
    if lock_memory == "try" and not info["locked"]:
        note = f"expert cache not locked in memory: {memory.memlock_fix_hint(region_bytes, info['lock_errno'])}"
        log.warning("%s", note)
        notes.append(note)
    return slab
