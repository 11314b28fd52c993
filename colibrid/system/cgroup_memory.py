"""The memory limit of the cgroup colibrid runs in: systemd's MemoryMax=, a container's
--memory, a Kubernetes limit. MemAvailable knows nothing of it, so a cache sized from
MemAvailable alone can be bigger than the whole allowance, and the kernel's OOM killer ends
the daemon.

Where the numbers are (all read, never written):

    /proc/self/cgroup     v1: "4:memory:/system.slice/colibrid.service"  v2: "0::/system.slice/..."
    /proc/self/mountinfo  where each hierarchy is mounted, and which part of it (its root)
    v1 files              memory.limit_in_bytes (9223372036854771712, PAGE_COUNTER_MAX pages,
                          means no limit), memory.usage_in_bytes, memory.stat total_inactive_file
    v2 files              memory.max and memory.high ("max" means none), memory.current,
                          memory.stat inactive_file

A limit binds every cgroup below it, so the walk goes from our cgroup up to the top of the
mounted hierarchy, and the cgroup with the least headroom wins. Headroom is the limit minus
the working set: what is charged, less the inactive page cache, which the kernel reclaims
before it OOM-kills anybody (the kubelet's "working set" is the same number). Active page
cache is counted as used: it may be the pack's own dense weights, which we want to keep.

Hugetlb pages are not charged here: cgroup v1 never charges them to the memory controller,
and v2 charges them to memory.current only when the hierarchy is mounted with
memory_hugetlb_accounting (Linux 6.6+); otherwise only the hugetlb controller counts them.
``CgroupLimit.counts_hugetlb`` says which.

``root`` is "/" on a real machine; tests point it at a fake tree holding proc/self/cgroup,
proc/self/mountinfo and the cgroup files under the mount points that mountinfo names.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from colibrid.sizes import format_bytes

log = logging.getLogger(__name__)

ROOT = Path("/")
# cgroup v1 reports "no limit" as PAGE_COUNTER_MAX pages in bytes (9223372036854771712 with
# 4 KiB pages, a little less with larger pages): anything this large is no limit.
V1_UNLIMITED_BYTES = 1 << 62
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class CgroupLimit:
    """The memory limit that binds this process, and what is already charged against it."""

    version: int  # 1 or 2
    cgroup: str  # as /proc/self/cgroup names it, e.g. "/system.slice/colibrid.service"
    limit_file: str  # the file the limit was read from: memory.max, memory.high, memory.limit_in_bytes
    limit_bytes: int
    usage_bytes: int  # the working set: charged, less the inactive page cache
    counts_hugetlb: bool  # hugetlb pages are charged to this limit (v2 with memory_hugetlb_accounting)

    @property
    def headroom_bytes(self) -> int:
        return max(0, self.limit_bytes - self.usage_bytes)

    def describe(self) -> str:
        return (f"cgroup v{self.version} {self.cgroup}: {self.limit_file} {format_bytes(self.limit_bytes)}, "
                f"{format_bytes(self.usage_bytes)} in use")


@dataclass(frozen=True)
class _Mount:
    root: str  # the part of the hierarchy mounted there ("/" unless a container sees only its own)
    mount_point: Path
    options: frozenset[str]  # super options: "memory" for the v1 controller, "memory_hugetlb_accounting"


def memory_limit(root: Path = ROOT) -> CgroupLimit | None:
    """The binding memory limit of this process's cgroup; None when there is no memory
    controller, no limit anywhere up the tree, or the files cannot be read."""
    try:
        memberships = parse_proc_cgroup((root / "proc/self/cgroup").read_text())
        mounts = parse_mountinfo((root / "proc/self/mountinfo").read_text())
    except OSError as exc:
        log.debug("cgroup memory limit not read: %s", exc)
        return None
    v1_path = next((path for controllers, path in memberships.items() if "memory" in controllers.split(",")), None)
    v1_mount = next((m for m in mounts.get("cgroup", []) if "memory" in m.options), None)
    if v1_path is not None and v1_mount is not None:
        return _tightest(1, v1_path, v1_mount, root)
    v2_path, v2_mount = memberships.get(""), next(iter(mounts.get("cgroup2", [])), None)
    if v2_path is not None and v2_mount is not None:
        return _tightest(2, v2_path, v2_mount, root)
    return None


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """/proc/self/cgroup as {controllers: path}: "memory" (v1), "" (the v2 hierarchy)."""
    memberships = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            memberships[parts[1]] = parts[2]
    return memberships


def parse_mountinfo(text: str) -> dict[str, list[_Mount]]:
    """The cgroup mounts of /proc/self/mountinfo by file system type ("cgroup", "cgroup2")."""
    mounts: dict[str, list[_Mount]] = {}
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        if dash < 5 or len(fields) < dash + 4:
            continue
        fs_type = fields[dash + 1]
        if fs_type not in ("cgroup", "cgroup2"):
            continue
        options = frozenset(fields[dash + 3].split(","))
        mounts.setdefault(fs_type, []).append(_Mount(_unescape(fields[3]), Path(_unescape(fields[4])), options))
    return mounts


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes (\\040)."""
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def _tightest(version: int, cgroup: str, mount: _Mount, root: Path) -> CgroupLimit | None:
    """The limit with the least headroom from our cgroup up to the top of the mount."""
    directory = _directory_of(cgroup, mount, root)
    if directory is None:
        return None
    top = root / mount.mount_point.relative_to("/")
    counts_hugetlb = version == 2 and "memory_hugetlb_accounting" in mount.options
    tightest = None
    name = cgroup
    while True:
        limit = _limit_at(version, directory, name, counts_hugetlb)
        if limit is not None and (tightest is None or limit.headroom_bytes < tightest.headroom_bytes):
            tightest = limit
        if directory == top or (version == 1 and _read(directory.parent / "memory.use_hierarchy") == "0"):
            break  # the top of what we can see, or a v1 parent whose limits do not cover its children
        directory, name = directory.parent, str(PurePosixPath(name).parent)
    return tightest


def _directory_of(cgroup: str, mount: _Mount, root: Path) -> Path | None:
    """Our cgroup's directory under the mount, or None when the mount does not show it."""
    path = PurePosixPath(cgroup)
    if not path.is_absolute() or ".." in path.parts:
        return None  # outside our cgroup namespace: "/../.."
    mount_root = PurePosixPath(mount.root)
    try:
        inside = path.relative_to(mount_root)
    except ValueError:
        log.debug("cgroup %s is not under the mounted part %s of its hierarchy", cgroup, mount.root)
        return None
    directory = root / mount.mount_point.relative_to("/") / inside
    return directory if directory.is_dir() else None


def _limit_at(version: int, directory: Path, name: str, counts_hugetlb: bool) -> CgroupLimit | None:
    if version == 1:
        limits = {"memory.limit_in_bytes": _read_bytes(directory / "memory.limit_in_bytes")}
        charged = _read_bytes(directory / "memory.usage_in_bytes")
        inactive_field = "total_inactive_file"  # the hierarchical figure, as usage_in_bytes is
    else:
        limits = {file: _read_bytes(directory / file) for file in ("memory.max", "memory.high")}
        charged = _read_bytes(directory / "memory.current")
        inactive_field = "inactive_file"  # v2's memory.stat is hierarchical already
    limits = {file: value for file, value in limits.items() if value is not None and value < V1_UNLIMITED_BYTES}
    if not limits or charged is None:
        return None
    limit_file = min(limits, key=limits.__getitem__)
    inactive = _stat_field(directory / "memory.stat", inactive_field) or 0
    return CgroupLimit(version, name, limit_file, limits[limit_file], max(0, charged - inactive), counts_hugetlb)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _read_bytes(path: Path) -> int | None:
    """A number of bytes from a cgroup file; None for "max" (no limit) or a missing file."""
    text = _read(path)
    return int(text) if text is not None and text.isdigit() else None


def _stat_field(path: Path, field: str) -> int | None:
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == field and value.strip().isdigit():
            return int(value)
    return None
