"""Which CPUs each kind of thread runs on, and the process's scheduling priority.

The engine thread (and the native compute threads it starts, which inherit its mask) runs
the matrix products; they are limited by each core's vector units and memory bandwidth, so
two of them on the SMT siblings of one core only take turns. So by default compute gets one
logical CPU per physical core - "physical cores first" - and the server's event loop and the
I/O threads, which mostly wait, get the SMT siblings that compute leaves idle. A machine
without SMT (like the 2-core CI machines) has no idle siblings: there the light threads may
run anywhere, which costs the engine little because they are asleep almost all the time.

Linux applies sched_setaffinity(0, ...) and setpriority(PRIO_PROCESS, 0, ...) to the calling
*thread*, and a new thread inherits its creator's mask: that is what lets colibrid pin threads
one by one with only the standard library.

The topology is read from sysfs (topology/core_cpus_list, falling back to the older
thread_siblings_list); `sysfs_root` lets tests describe any machine with a fake tree.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

AUTO = "auto"


class CpuListError(ValueError):
    """A CPU list that is malformed or names CPUs colibrid may not use; str() says which."""


def parse_cpu_list(text: str) -> frozenset[int]:
    """The kernel's (and taskset's, and systemd's CPUAffinity=) list format: "0-3,8,10-11"."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if part == "":
            raise CpuListError(f"empty item in CPU list {text!r}")
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise CpuListError(f"{part!r} in {text!r} is not a CPU number or a range like 0-3")
        low, high = int(first), int(last or first)
        if high < low:
            raise CpuListError(f"range {part!r} in {text!r} goes backwards")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """{0, 1, 2, 3, 8} -> "0-3,8": how status and the log show a set of CPUs."""
    ordered = sorted(cpus)
    ranges: list[str] = []
    start = previous = None
    for cpu in ordered + [None]:
        if start is not None and (cpu is None or cpu != previous + 1):
            ranges.append(str(start) if start == previous else f"{start}-{previous}")
            start = None
        if cpu is not None and start is None:
            start = cpu
        previous = cpu
    return ",".join(ranges)


def available_cpus() -> frozenset[int]:
    """The CPUs this process may run on (its cgroup cpuset and inherited mask already applied)."""
    return frozenset(os.sched_getaffinity(0))


def check_cpu_setting(value: str, available: frozenset[int] | None = None) -> frozenset[int] | None:
    """None for "auto", else the CPUs named; CpuListError if any of them is not available."""
    if value == AUTO:
        return None
    cpus = parse_cpu_list(value)
    available = available_cpus() if available is None else available
    missing = cpus - available
    if missing:
        raise CpuListError(f"CPUs {format_cpu_list(missing)} are not available to colibrid "
                           f"(it may use {format_cpu_list(available)})")
    return cpus


@dataclass(frozen=True)
class Topology:
    cores: tuple[tuple[int, ...], ...]  # each physical core's available logical CPUs, lowest first

    @classmethod
    def read(cls, available: frozenset[int] | None = None, sysfs_root: Path = Path("/sys")) -> "Topology":
        available = available_cpus() if available is None else available
        cpu_dir = sysfs_root / "devices" / "system" / "cpu"
        cores: dict[frozenset[int], None] = {}  # insertion-ordered set of sibling groups
        for cpu in sorted(available):
            siblings = _read_siblings(cpu_dir / f"cpu{cpu}" / "topology")
            group = frozenset((siblings or {cpu}) & available) or frozenset({cpu})
            cores.setdefault(group, None)
        return cls(tuple(tuple(sorted(group)) for group in cores))

    @property
    def physical(self) -> frozenset[int]:
        """One logical CPU per physical core: the first of its siblings."""
        return frozenset(core[0] for core in self.cores)

    @property
    def smt_siblings(self) -> frozenset[int]:
        """The other logical CPUs of each core (empty without SMT)."""
        return frozenset(cpu for core in self.cores for cpu in core[1:])


def _read_siblings(topology_dir: Path) -> frozenset[int] | None:
    for name in ("core_cpus_list", "thread_siblings_list"):
        try:
            return parse_cpu_list((topology_dir / name).read_text().strip())
        except (OSError, CpuListError):
            continue
    return None  # no topology in sysfs (some containers): every CPU is its own core


@dataclass(frozen=True)
class CpuPlan:
    compute: frozenset[int]  # the engine thread and the native threads it starts
    io: frozenset[int]  # the event loop (server) and the threads it starts

    def describe(self) -> dict[str, str]:
        return {"compute": format_cpu_list(self.compute), "io": format_cpu_list(self.io)}


def plan_cpus(cpu_affinity: str, io_cpus: str, topology: Topology) -> CpuPlan:
    """The CPUs of each kind of thread: the configured lists, or defaults from the topology."""
    every_cpu = frozenset(cpu for core in topology.cores for cpu in core)
    compute = check_cpu_setting(cpu_affinity, every_cpu) or topology.physical
    io = check_cpu_setting(io_cpus, every_cpu)
    if io is None:
        io = (topology.smt_siblings - compute) or every_cpu
    return CpuPlan(compute, io)


def pin_current_thread(cpus: frozenset[int]) -> None:
    os.sched_setaffinity(0, cpus)


def apply_nice(nice: int) -> int:
    """Set the calling thread's niceness (threads started later inherit it); return what is in force.

    Lowering niceness below the inherited value needs CAP_SYS_NICE (or RLIMIT_NICE); without it
    the setting is logged and skipped rather than failing the start: it changes speed, not results.
    """
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if nice == 0 or nice == current:
        return current
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except PermissionError:
        log.warning("nice = %d not applied: lowering niceness needs CAP_SYS_NICE (AmbientCapabilities= in the "
                    "unit) or a higher RLIMIT_NICE; running at %d", nice, current)
        return current
    log.info("niceness set to %d (was %d)", nice, current)
    return nice
