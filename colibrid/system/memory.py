"""The machine's memory as the daemon sees it: the memory budget (MemAvailable, or less under
a cgroup memory limit), sizes from the config ("6G", "40%"), hugetlb pages for the expert
cache (vm.nr_hugepages), and the mlock limit.

Nothing here changes the machine silently: every write to /proc/sys is logged with the
values before and after, and undone by ``HugepageReservation.release()``. What a process
raised is also written down in a record file (``HugepageRecord``), so that when it dies
without giving the pages back (SIGKILL, a crash), the next colibrid to start gives them back.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import resource
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from colibrid.sizes import format_bytes, is_percentage, size_in_bytes
from colibrid.system import cgroup_memory
from colibrid.system.cgroup_memory import CgroupLimit

log = logging.getLogger(__name__)

MEMINFO = Path("/proc/meminfo")
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
HUGE_PAGE_BYTES = 2 * 1024 * 1024
# Where colibrid writes down the hugetlb pages it raised (the config's hugepage_record).
DEFAULT_HUGEPAGE_RECORD = Path("/run/colibri/hugepages.json")
# A record is a few lines; anything bigger was not written by us.
MAX_RECORD_BYTES = 64 * 1024

def meminfo(path: Path | None = None) -> dict[str, int]:
    """/proc/meminfo (or ``path``) as {field: bytes} (page counts such as HugePages_Free stay counts)."""
    out: dict[str, int] = {}
    for line in (path or MEMINFO).read_text().splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if not fields:
            continue
        value = int(fields[0])
        out[name] = value * 1024 if len(fields) > 1 and fields[1] == "kB" else value
    return out


@dataclass(frozen=True)
class MemoryBudget:
    """The memory a percentage ("50%") is of: the smaller of MemAvailable and the headroom
    under the cgroup memory limit (limit minus working set), measured once, at sizing time.

    Hugetlb pages count against neither cgroup v1's memory limit nor, by default, v2's (see
    colibrid.system.cgroup_memory): a cache in hugetlb pages is still sized from this budget, so it
    only ever takes less of the limit than budgeted, never more."""

    mem_available_bytes: int
    cgroup: CgroupLimit | None  # None: no memory limit applies

    @property
    def limited_by_cgroup(self) -> bool:
        return self.cgroup is not None and self.cgroup.headroom_bytes < self.mem_available_bytes

    @property
    def limit_ignores_hugetlb(self) -> bool:
        """A cgroup memory limit applies that does not count hugetlb pages: a hugetlb cache
        would live outside it, so hugepages = "auto" does not raise vm.nr_hugepages under it."""
        return self.cgroup is not None and not self.cgroup.counts_hugetlb

    @property
    def available_bytes(self) -> int:
        return self.cgroup.headroom_bytes if self.limited_by_cgroup else self.mem_available_bytes

    @property
    def basis(self) -> str:
        """Which number the budget is: "MemAvailable" or the cgroup limit, with its figures."""
        return self.cgroup.describe() if self.limited_by_cgroup else "MemAvailable"

    def describe(self) -> str:
        return f"memory budget {format_bytes(self.available_bytes)} ({self.basis})"

    def hugetlb_treatment(self) -> str:
        """How hugetlb pages relate to the limit, for status."""
        if self.cgroup is None:
            return "no cgroup memory limit"
        if self.cgroup.counts_hugetlb:
            return "charged to the cgroup memory limit (memory_hugetlb_accounting)"
        return (f"not charged to the cgroup v{self.cgroup.version} memory limit (only the hugetlb controller "
                "counts them): a hugetlb cache is outside the limit, so hugepages = \"auto\" does not raise "
                "vm.nr_hugepages under it")

    def status(self) -> dict:
        return {
            "available_bytes": self.available_bytes,
            "basis": self.basis,
            "mem_available_bytes": self.mem_available_bytes,
            "cgroup_limit_bytes": self.cgroup.limit_bytes if self.cgroup else None,
            "cgroup_usage_bytes": self.cgroup.usage_bytes if self.cgroup else None,
            "hugetlb": self.hugetlb_treatment(),
        }


def measure_budget(meminfo_path: Path | None = None, cgroup_root: Path = cgroup_memory.ROOT) -> MemoryBudget:
    """MemAvailable and the cgroup memory limit, now."""
    return MemoryBudget(meminfo(meminfo_path)["MemAvailable"], cgroup_memory.memory_limit(cgroup_root))


def parse_size(value: int | str, what: str = "size", available_bytes: int | None = None) -> int:
    """colibrid.sizes.size_in_bytes, a percentage being of the memory budget (MemAvailable, or
    the headroom under the cgroup memory limit when that is smaller) measured now unless
    ``available_bytes`` is given."""
    if available_bytes is None and is_percentage(value):
        available_bytes = measure_budget().available_bytes
    return size_in_bytes(value, what, available_bytes)


# --------------------------------------------------------------------------------------------
# Hugetlb pages
# --------------------------------------------------------------------------------------------


def _read_nr_hugepages() -> int:
    return int(NR_HUGEPAGES.read_text())


def _set_nr_hugepages(before: int, after: int, why: str) -> None:
    NR_HUGEPAGES.write_text(str(after))
    log.info("vm.nr_hugepages: %d -> %d (%s)", before, after, why)


class HugepageRecord:
    """Which processes raised vm.nr_hugepages by how many pages and have not lowered it again,
    in one JSON file (default /run/colibri/hugepages.json, the config's hugepage_record):

        {"raised": [{"pid": 1234, "started": 81234, "pages": 24}]}

    ``started`` is the process's start time (clock ticks after boot, /proc/PID/stat field 22),
    so a pid the kernel has given to another process is not mistaken for the one that wrote it.
    Reading, changing vm.nr_hugepages and writing happen under one flock of the record's
    directory, so two colibrids starting at once do not give back each other's pages. We are
    root when we write it, in a directory others may write to: the file is opened relative to
    that directory, never through a symbolic link, trusted only if our user owns it, and
    replaced whole (a new file, then rename), never written in place.
    """

    def __init__(self, path: Path = DEFAULT_HUGEPAGE_RECORD) -> None:
        self.path = Path(path)
        self._directory_fd: int | None = None  # set while locked()

    @contextmanager
    def locked(self, create: bool = True) -> Iterator[bool]:
        """Holds the record's lock for the block; yields False if the record cannot be used
        (its directory cannot be created or opened: not root, a read-only /run; or it does not
        exist and not ``create``), after which every method does nothing."""
        try:
            if create:
                self.path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            log.debug("hugepage record %s not usable: %s", self.path, exc)
            yield False
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._directory_fd = fd
            yield True
        finally:
            self._directory_fd = None
            os.close(fd)  # also releases the flock

    def add(self, pages: int) -> None:
        """Writes down that this process raised vm.nr_hugepages by ``pages`` more."""
        me = os.getpid()
        entries = self._read()
        mine = next((e for e in entries if e["pid"] == me), None)
        if mine is None:
            entries.append({"pid": me, "started": _start_ticks(me), "pages": pages})
        else:
            mine["pages"] += pages
        if not self._write(entries):
            log.warning("%d hugepages raised but not written down in %s: if colibrid is killed, "
                        "give them back with `sysctl vm.nr_hugepages=N`", pages, self.path)

    def forget(self, pages: int) -> None:
        """This process gave ``pages`` back."""
        me = os.getpid()
        entries = self._read()
        for entry in entries:
            if entry["pid"] == me:
                entry["pages"] -= pages
        self._write([e for e in entries if e["pages"] > 0])

    def return_orphaned_pages(self) -> int:
        """Gives back the pages of every recorded process that is gone (killed, crashed): only
        those still free, so nothing another program uses now is taken. Returns the pages given back."""
        entries = self._read()
        kept, returned = [], 0
        for entry in entries:
            if _start_ticks(entry["pid"]) == entry["started"]:
                kept.append(entry)  # still running: its pages are its own
                continue
            try:
                returned += _return_pages(entry["pages"], entry["pid"])
            except OSError as exc:
                log.warning("colibrid pid %d raised vm.nr_hugepages by %d and exited without lowering it, "
                            "and it cannot be lowered now (%s): run `sysctl vm.nr_hugepages=N` as root",
                            entry["pid"], entry["pages"], exc.strerror)
                kept.append(entry)
        if kept != entries:
            self._write(kept)
        return returned

    def _read(self) -> list[dict]:
        if self._directory_fd is None:
            return []
        try:
            fd = os.open(self.path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._directory_fd)
        except FileNotFoundError:
            return []
        except OSError as exc:  # ELOOP: a symbolic link planted in its place
            log.warning("hugepage record %s not read: %s", self.path, exc.strerror)
            return []
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_size > MAX_RECORD_BYTES:
                log.warning("hugepage record %s ignored: not a regular file of %d bytes at most owned by uid %d",
                            self.path, MAX_RECORD_BYTES, os.geteuid())
                return []
            text = f.read(MAX_RECORD_BYTES)
        return _parse_record(text, self.path)

    def _write(self, entries: list[dict]) -> bool:
        if self._directory_fd is None:
            return False
        d = self._directory_fd
        try:
            if not entries:
                try:
                    os.unlink(self.path.name, dir_fd=d)
                except FileNotFoundError:
                    pass
                return True
            temporary = f".{self.path.name}.{os.getpid()}.tmp"
            try:
                os.unlink(temporary, dir_fd=d)  # left by a process with our pid that died mid-write
            except FileNotFoundError:
                pass
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                         dir_fd=d)
            with os.fdopen(fd, "w") as f:
                json.dump({"raised": entries}, f)
            os.rename(temporary, self.path.name, src_dir_fd=d, dst_dir_fd=d)
            return True
        except OSError as exc:
            log.warning("hugepage record %s not written: %s", self.path, exc.strerror)
            return False


def _parse_record(text: bytes, path: Path) -> list[dict]:
    """The record's entries; ones that are not {"pid": int, "started": int, "pages": int > 0} are dropped."""
    try:
        raised = json.loads(text)["raised"]
        entries = [{"pid": e["pid"], "started": e["started"], "pages": e["pages"]} for e in raised]
    except (ValueError, KeyError, TypeError):
        log.warning("hugepage record %s is not a record colibrid wrote; ignoring it", path)
        return []
    return [e for e in entries if all(type(v) is int for v in e.values()) and e["pages"] > 0 and e["pid"] > 0]


def _start_ticks(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks after boot); None if it is gone or a zombie
    (whose memory, hugetlb pages included, the kernel has freed already)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # after "pid (comm) ": state is field 3, starttime 22
    if len(fields) < 20 or fields[0] == "Z":
        return None
    return int(fields[19])


def _return_pages(pages: int, pid: int) -> int:
    """Lowers vm.nr_hugepages by up to ``pages`` that process ``pid`` raised and never gave back;
    only by pages that are free and not reserved by a mapping, so no one's pages are taken."""
    info = meminfo()
    spare = max(0, int(info.get("HugePages_Free", 0)) - int(info.get("HugePages_Rsvd", 0)))
    returnable = min(pages, spare)
    if returnable:
        before = _read_nr_hugepages()
        _set_nr_hugepages(before, before - returnable,
                          f"gave back the pages colibrid pid {pid} raised and never returned: it was killed or crashed")
    if returnable < pages:
        log.warning("%d of the hugepages colibrid pid %d raised are in use by others now: left in the pool",
                    pages - returnable, pid)
    return returnable


def return_orphaned_hugepages(record: HugepageRecord) -> int:
    """At start: give back what an earlier colibrid raised and did not return (see HugepageRecord)."""
    with record.locked(create=False):  # no record directory: nothing was ever written down
        return record.return_orphaned_pages()


@dataclass
class HugepageReservation:
    """What was done to vm.nr_hugepages for one pool; ``release()`` gives the pages back."""

    pages_needed: int
    pages_free_before: int
    pages_added: int = 0  # written to vm.nr_hugepages by us
    available: bool = False  # enough free hugetlb pages for the pool now
    message: str = ""  # one line for logs and status
    record: HugepageRecord | None = field(default=None, repr=False)  # where pages_added is written down

    def release(self) -> None:
        """Lowers vm.nr_hugepages by what we added. Safe while the pool is still mapped: pages
        in use beyond the new count become surplus pages, freed when they are unmapped."""
        if self.pages_added <= 0:
            return
        with _locked(self.record):
            try:
                current = _read_nr_hugepages()
                _set_nr_hugepages(current, max(0, current - self.pages_added), "returned the expert cache's pages")
            except OSError as exc:  # the record keeps them: the next colibrid to start gives them back
                log.warning("could not return %d hugepages to the system: %s", self.pages_added, exc)
            else:
                if self.record is not None:
                    self.record.forget(self.pages_added)
        self.pages_added = 0


@contextmanager
def _locked(record: HugepageRecord | None) -> Iterator[None]:
    if record is None:
        yield
    else:
        with record.locked():
            yield


def reserve_hugepages(region_bytes: int, raise_pool: bool, target_total: int | None = None,
                      record: HugepageRecord | None = None) -> HugepageReservation:
    """Makes sure ``region_bytes`` of 2 MiB hugetlb pages are free, raising vm.nr_hugepages
    when ``raise_pool`` and we may (root, writable /proc/sys). ``target_total``: raise the
    system pool to at least this many pages instead (hugepages = N in the config). Pages added
    are written down in ``record`` (after the pages of dead processes in it are given back)."""
    if record is None or not raise_pool:
        return _reserve(region_bytes, raise_pool, target_total)
    with record.locked():
        record.return_orphaned_pages()
        res = _reserve(region_bytes, raise_pool, target_total)
        if res.pages_added:
            record.add(res.pages_added)
            res.record = record
    return res


def _reserve(region_bytes: int, raise_pool: bool, target_total: int | None) -> HugepageReservation:
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
