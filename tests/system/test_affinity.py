"""Core pinning: CPU lists, topology from a fake sysfs, the default plan (physical cores first)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from colibrid.system.affinity import (
    CpuListError, CpuPlan, Topology, apply_nice, format_cpu_list, parse_cpu_list, plan_cpus,
)


def fake_sysfs(root: Path, siblings: dict[int, str]) -> Path:
    """cpuN/topology/core_cpus_list for each CPU, as the kernel writes it."""
    for cpu, core_cpus in siblings.items():
        topology = root / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "core_cpus_list").write_text(core_cpus + "\n")
    return root


def test_cpu_lists_round_trip():
    assert parse_cpu_list("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}
    assert format_cpu_list({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"
    for bad in ("", "a", "3-1", "1,,2", "-1"):
        with pytest.raises(CpuListError):
            parse_cpu_list(bad)


def test_smt_machine_compute_on_one_thread_per_core_io_on_the_siblings(tmp_path):
    # 4 cores x 2 threads, Linux's usual numbering: cpu N and N+4 share a core.
    sysfs = fake_sysfs(tmp_path, {cpu: f"{cpu % 4},{cpu % 4 + 4}" for cpu in range(8)})
    topology = Topology.read(frozenset(range(8)), sysfs)
    assert topology.cores == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert plan_cpus("auto", "auto", topology) == CpuPlan(frozenset({0, 1, 2, 3}), frozenset({4, 5, 6, 7}))
    assert plan_cpus("0-1", "auto", topology) == CpuPlan(frozenset({0, 1}), frozenset({4, 5, 6, 7}))
    assert plan_cpus("auto", "3", topology).io == {3}


def test_without_smt_the_io_threads_may_run_anywhere(tmp_path):
    sysfs = fake_sysfs(tmp_path, {0: "0", 1: "1"})
    assert plan_cpus("auto", "auto", Topology.read(frozenset({0, 1}), sysfs)) == CpuPlan(
        frozenset({0, 1}), frozenset({0, 1}))


def test_only_the_cpus_of_our_cpuset_count(tmp_path):
    sysfs = fake_sysfs(tmp_path, {cpu: f"{cpu % 4},{cpu % 4 + 4}" for cpu in range(8)})
    topology = Topology.read(frozenset({2, 3, 6}), sysfs)  # a cgroup cpuset or taskset gave us these
    assert topology.cores == ((2, 6), (3,))
    with pytest.raises(CpuListError, match="CPUs 0 are not available to colibrid"):
        plan_cpus("0,2", "auto", topology)


def test_a_cpu_list_naming_unavailable_cpus_is_a_config_error(demo_pack):
    from colibrid.daemon.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=r'cpu_affinity = "0-4095": "auto" or a CPU list'):
        load_config(["--model", str(demo_pack), "--cpu-affinity", "0-4095", "--config", os.devnull])


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to nobody")
def test_a_lower_niceness_without_cap_sys_nice_is_logged_and_skipped():
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # a child that has dropped every privilege tries to raise its priority
        try:
            os.setgid(65534), os.setuid(65534)
            os.write(write_end, str(apply_nice(-5)).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        in_force = int(pipe.read())
    os.waitpid(pid, 0)
    assert in_force == os.getpriority(os.PRIO_PROCESS, 0)  # unchanged, and the child did not fail
