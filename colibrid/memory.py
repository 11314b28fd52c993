"""The machine's memory as the daemon sees it: sizes from the config ("6G", "40%"),
hugetlb pages for the expert cache (vm.nr_hugepages), and the mlock limit.

Nothing here changes the machine silently: every write to /proc/sys is logged with the
values before and after, and undone by ``HugepageReservation.release()``.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import resource
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MEMINFO = Path("/proc/meminfo")
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
HUGE_PAGE_BYTES = 2 * 1024 * 1024

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_PERCENT_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def meminfo(path: Path = MEMINFO) -> dict[str, int]:
    """/proc/meminfo as {field: bytes} (page counts such as HugePages_Free stay counts)."""
    out: dict[str, int] = {}
    for line in path.read_text().splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if not fields:
            continue
        value = int(fields[0])
        out[name] = value * 1024 if len(fields) > 1 and fields[1] == "kB" else value
    return out


def parse_size(value: int | str, what: str = "size", available_bytes: int | None = None) -> int:
    """Bytes from 123, "512M", "6G", "6GiB", "1.5T" (binary units) or "40%" (of MemAvailable,
    or of ``available_bytes`` when given). Raises ValueError with the accepted forms."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a size such as \"6G\" or \"40%\", got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what} must not be negative, got {value}")
        return value
    text = str(value)
    percent = _PERCENT_RE.match(text)
    if percent:
        fraction = float(percent.group(1)) / 100.0
        if not 0 < fraction <= 1:
            raise ValueError(f"{what} {text!r}: a percentage must be in (0, 100]")
        base = available_bytes if available_bytes is not None else meminfo()["MemAvailable"]
        return int(base * fraction)
    size = _SIZE_RE.match(text)
    if not size:
        raise ValueError(f"{what} {text!r} is not a size: use bytes (123), K/M/G/T (\"512M\", \"6G\") or \"40%\"")
    return int(float(size.group(1)) * _UNITS[size.group(2).lower()])


def format_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


# --------------------------------------------------------------------------------------------
# Hugetlb pages
# --------------------------------------------------------------------------------------------


@dataclass
class HugepageReservation:
    """What was done to vm.nr_hugepages for one pool; ``release()`` gives the pages back."""

    pages_needed: int
    pages_free_before: int
    pages_added: int = 0  # written to vm.nr_hugepages by us
    available: bool = False  # enough free hugetlb pages for the pool now
    message: str = ""  # one line for logs and status

    def release(self) -> None:
        """Lowers vm.nr_hugepages by what we added (call after the pool is unmapped)."""
        if self.pages_added <= 0:
            return
        try:
            current = int(NR_HUGEPAGES.read_text())
            NR_HUGEPAGES.write_text(str(max(0, current - self.pages_added)))
            log.info("vm.nr_hugepages: %d -> %d (returned the expert cache's pages)", current,
                     max(0, current - self.pages_added))
        except OSError as exc:
            log.warning("could not return %d hugepages to the system: %s", self.pages_added, exc)
        self.pages_added = 0


def reserve_hugepages(region_bytes: int, raise_pool: bool, target_total: int | None = None) -> HugepageReservation:
    """Makes sure ``region_bytes`` of 2 MiB hugetlb pages are free, raising vm.nr_hugepages
    when ``raise_pool`` and we may (root, writable /proc/sys). ``target_total``: raise the
    system pool to at least this many pages instead (hugepages = N in the config)."""
    needed = -(-region_bytes // HUGE_PAGE_BYTES)
    info = meminfo()
    free = int(info.get("HugePages_Free", 0))
    page_size = int(info.get("Hugepagesize", HUGE_PAGE_BYTES))
    res = HugepageReservation(pages_needed=needed, pages_free_before=free)
    if page_size != HUGE_PAGE_BYTES:
        res.message = f"default hugepage size is {page_size} bytes, not 2 MiB: hugetlb pages not used"
        return res
    total = int(info.get("HugePages_Total", 0))
    want_total = total + max(0, needed - free)
    if target_total is not None:
        want_total = max(want_total, target_total)
    if free >= needed and want_total <= total:
        res.available = True
        res.message = f"{needed} hugetlb pages of {free} free"
        return res
    if not raise_pool:
        res.message = f"{needed} hugetlb pages needed, {free} free (vm.nr_hugepages = {total})"
        return res
    try:
        NR_HUGEPAGES.write_text(str(want_total))
        now_total = int(NR_HUGEPAGES.read_text())
    except OSError as exc:
        reason = "not root" if exc.errno in (errno.EACCES, errno.EPERM) else exc.strerror
        res.message = (f"{needed} hugetlb pages needed, {free} free, and vm.nr_hugepages cannot be raised ({reason}): "
                       f"run `sysctl vm.nr_hugepages={want_total}` as root, or set hugepages = \"off\"")
        return res
    res.pages_added = max(0, now_total - total)
    free_now = int(meminfo().get("HugePages_Free", 0))
    res.available = free_now >= needed
    res.message = (f"vm.nr_hugepages: {total} -> {now_total} for the expert cache ({needed} pages of 2 MiB); "
                   f"{free_now} free")
    if not res.available:
        res.message += " — memory too fragmented for the kernel to find them all"
    log.info("%s", res.message)
    return res


# --------------------------------------------------------------------------------------------
# mlock
# --------------------------------------------------------------------------------------------


def memlock_limit() -> int | None:
    """RLIMIT_MEMLOCK soft limit in bytes; None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def memlock_fix_hint(region_bytes: int, lock_errno: int) -> str:
    """How to let colibrid lock ``region_bytes``, for the error after mlock failed."""
    limit = memlock_limit()
    limit_text = "unlimited" if limit is None else format_bytes(limit)
    reason = os.strerror(lock_errno) if lock_errno else "refused"
    if lock_errno == errno.EAGAIN or lock_errno == errno.ENOMEM and limit is None:
        cause = "the kernel could not lock that much memory (too little RAM left)"
    else:
        cause = f"RLIMIT_MEMLOCK is {limit_text} and the process lacks CAP_IPC_LOCK"
    return (f"mlock of {format_bytes(region_bytes)} failed ({reason}): {cause}. Fix: set LimitMEMLOCK=infinity "
            f"in the colibrid.service unit (or `ulimit -l unlimited` before starting colibrid), or grant "
            f"CAP_IPC_LOCK (AmbientCapabilities=CAP_IPC_LOCK); or lower cache_size; or set lock_memory = \"try\"")
