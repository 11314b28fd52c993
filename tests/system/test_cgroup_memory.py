"""colibrid.system.cgroup_memory finds the memory limit that binds this process, on fake cgroup v1 and
v2 trees laid out as the kernel does, and on this machine's real memory controller."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from colibrid.system.cgroup_memory import CgroupLimit, memory_limit, parse_mountinfo, parse_proc_cgroup

MiB = 1 << 20
V1_UNLIMITED = "9223372036854771712"

V1_MOUNTINFO = """\
25 30 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
31 25 0:28 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
35 31 0:32 {root} /sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime shared:14 - cgroup cgroup rw,memory
36 31 0:33 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid,nodev,noexec,relatime shared:15 - cgroup cgroup rw,cpu,cpuacct
41 31 0:38 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:10 - cgroup2 cgroup2 rw
"""
V2_MOUNTINFO = """\
25 30 0:23 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
31 25 0:27 {root} /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate{options}
"""


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def v1_tree(root: Path, cgroup: str, groups: dict[str, dict[str, str]], mount_root: str = "/") -> Path:
    """/proc/self/{cgroup,mountinfo} for a process in ``cgroup`` of a v1 memory hierarchy, and
    the files of each group (paths relative to the mount) in ``groups``."""
    _write(root / "proc/self/cgroup", f"5:cpu,cpuacct:/\n4:memory:{cgroup}\n1:name=systemd:{cgroup}\n0::/\n")
    _write(root / "proc/self/mountinfo", V1_MOUNTINFO.format(root=mount_root))
    for group, files in groups.items():
        for name, text in files.items():
            _write(root / "sys/fs/cgroup/memory" / group.lstrip("/") / name, text + "\n")
    return root


def v1_group(limit: str, usage: int, inactive_file: int = 0, use_hierarchy: str = "1") -> dict[str, str]:
    return {"memory.limit_in_bytes": limit, "memory.usage_in_bytes": str(usage), "memory.use_hierarchy": use_hierarchy,
            "memory.stat": f"cache 0\nrss {usage}\ninactive_file 0\ntotal_inactive_file {inactive_file}\n"}


def v2_tree(root: Path, cgroup: str, groups: dict[str, dict[str, str]], mount_root: str = "/",
            options: str = "") -> Path:
    _write(root / "proc/self/cgroup", f"0::{cgroup}\n")
    _write(root / "proc/self/mountinfo", V2_MOUNTINFO.format(root=mount_root, options=options))
    for group, files in groups.items():
        for name, text in files.items():
            _write(root / "sys/fs/cgroup" / group.lstrip("/") / name, text + "\n")
    return root


def v2_group(maximum: str, current: int, inactive_file: int = 0, high: str = "max") -> dict[str, str]:
    return {"memory.max": maximum, "memory.high": high, "memory.current": str(current),
            "memory.stat": f"anon {current}\nfile 0\ninactive_file {inactive_file}\nactive_file 0\n"}


# ---- parsing ---------------------------------------------------------------------------------


def test_proc_cgroup_lines_map_controllers_to_paths():
    assert parse_proc_cgroup("4:memory:/a/b\n3:cpu,cpuacct:/\n0::/user.slice/x:y\n") == {
        "memory": "/a/b", "cpu,cpuacct": "/", "": "/user.slice/x:y"}


def test_mountinfo_finds_cgroup_mounts_and_unescapes_paths():
    mounts = parse_mountinfo("41 31 0:38 / /sys/fs/cgroup/with\\040space rw - cgroup2 cgroup2 rw,memory_hugetlb_accounting\n"
                             "35 31 0:32 /docker/abc /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n")
    (v2,), (v1,) = mounts["cgroup2"], mounts["cgroup"]
    assert v2.mount_point == Path("/sys/fs/cgroup/with space") and "memory_hugetlb_accounting" in v2.options
    assert v1.root == "/docker/abc" and "memory" in v1.options


# ---- cgroup v1 -------------------------------------------------------------------------------


def test_v1_limit_of_our_own_cgroup_minus_its_inactive_page_cache(tmp_path):
    root = v1_tree(tmp_path, "/system.slice/colibrid.service", {
        "/": v1_group(V1_UNLIMITED, 900 * MiB),
        "/system.slice": v1_group(V1_UNLIMITED, 500 * MiB),
        "/system.slice/colibrid.service": v1_group(str(400 * MiB), 150 * MiB, inactive_file=50 * MiB)})
    assert memory_limit(root) == CgroupLimit(1, "/system.slice/colibrid.service", "memory.limit_in_bytes",
                                             400 * MiB, 100 * MiB, counts_hugetlb=False)
    assert memory_limit(root).headroom_bytes == 300 * MiB


def test_v1_walks_up_to_the_nearest_limited_ancestor(tmp_path):
    root = v1_tree(tmp_path, "/kubepods/pod1/container", {
        "/": v1_group(V1_UNLIMITED, 900 * MiB),
        "/kubepods": v1_group(V1_UNLIMITED, 600 * MiB),
        "/kubepods/pod1": v1_group(str(256 * MiB), 64 * MiB),
        "/kubepods/pod1/container": v1_group(V1_UNLIMITED, 60 * MiB)})
    limit = memory_limit(root)
    assert (limit.cgroup, limit.limit_bytes, limit.headroom_bytes) == ("/kubepods/pod1", 256 * MiB, 192 * MiB)


def test_v1_the_limit_with_the_least_headroom_binds(tmp_path):
    root = v1_tree(tmp_path, "/outer/inner", {
        "/outer": v1_group(str(1024 * MiB), 1000 * MiB),  # 24 MiB left: siblings used the rest
        "/outer/inner": v1_group(str(512 * MiB), 100 * MiB)})
    assert memory_limit(root).cgroup == "/outer"


def test_v1_without_any_limit_is_none(tmp_path):
    root = v1_tree(tmp_path, "/user.slice", {"/": v1_group(V1_UNLIMITED, 1), "/user.slice": v1_group(V1_UNLIMITED, 1)})
    assert memory_limit(root) is None


def test_v1_parent_without_use_hierarchy_does_not_limit_its_children(tmp_path):
    root = v1_tree(tmp_path, "/old/child", {
        "/": v1_group(V1_UNLIMITED, 1),
        "/old": v1_group(str(64 * MiB), 10 * MiB, use_hierarchy="0"),
        "/old/child": v1_group(V1_UNLIMITED, 5 * MiB)})
    assert memory_limit(root) is None


def test_v1_container_that_mounts_only_its_own_cgroup(tmp_path):
    # Docker without a cgroup namespace: /proc/self/cgroup names /docker/abc, which is mounted
    # at /sys/fs/cgroup/memory itself.
    root = v1_tree(tmp_path, "/docker/abc", {"/": v1_group(str(2048 * MiB), 300 * MiB)}, mount_root="/docker/abc")
    limit = memory_limit(root)
    assert (limit.cgroup, limit.limit_bytes) == ("/docker/abc", 2048 * MiB)


# ---- cgroup v2 -------------------------------------------------------------------------------


def test_v2_memory_max_of_an_ancestor(tmp_path):
    root = v2_tree(tmp_path, "/system.slice/colibrid.service", {
        "/": {"cgroup.controllers": "memory"},  # the root cgroup has no memory.max
        "/system.slice": v2_group(str(4096 * MiB), 1024 * MiB, inactive_file=24 * MiB),
        "/system.slice/colibrid.service": v2_group("max", 200 * MiB)})
    limit = memory_limit(root)
    assert limit == CgroupLimit(2, "/system.slice", "memory.max", 4096 * MiB, 1000 * MiB, counts_hugetlb=False)


def test_v2_memory_high_below_memory_max_is_the_limit(tmp_path):
    root = v2_tree(tmp_path, "/app", {"/app": v2_group(str(1024 * MiB), 100 * MiB, high=str(768 * MiB))})
    limit = memory_limit(root)
    assert (limit.limit_file, limit.limit_bytes) == ("memory.high", 768 * MiB)


def test_v2_max_everywhere_is_no_limit(tmp_path):
    root = v2_tree(tmp_path, "/user.slice/user-0.slice", {
        "/user.slice": v2_group("max", 1), "/user.slice/user-0.slice": v2_group("max", 1)})
    assert memory_limit(root) is None


def test_v2_says_whether_hugetlb_pages_are_charged(tmp_path):
    plain = v2_tree(tmp_path / "plain", "/app", {"/app": v2_group(str(512 * MiB), 0)})
    accounted = v2_tree(tmp_path / "accounted", "/app", {"/app": v2_group(str(512 * MiB), 0)},
                        options=",memory_hugetlb_accounting")
    assert memory_limit(plain).counts_hugetlb is False
    assert memory_limit(accounted).counts_hugetlb is True


def test_v2_in_a_cgroup_namespace_sees_itself_as_the_root(tmp_path):
    root = v2_tree(tmp_path, "/", {"/": v2_group(str(256 * MiB), 16 * MiB)})
    assert memory_limit(root).limit_bytes == 256 * MiB


def test_hybrid_machine_with_memory_on_v1_reads_v1(tmp_path):
    root = v1_tree(tmp_path, "/svc", {"/svc": v1_group(str(128 * MiB), 0)})
    _write(root / "sys/fs/cgroup/unified/svc/memory.max", "4096\n")  # no memory controller there: ignored
    assert memory_limit(root).version == 1


@pytest.mark.parametrize("cgroup", ["/../..", "/not/mounted/here"])
def test_a_cgroup_outside_what_is_mounted_is_no_limit(tmp_path, cgroup):
    root = v2_tree(tmp_path, cgroup, {"/": v2_group(str(256 * MiB), 0)}, mount_root="/elsewhere")
    assert memory_limit(root) is None


def test_no_proc_files_is_no_limit(tmp_path):
    assert memory_limit(tmp_path) is None


# ---- this machine ----------------------------------------------------------------------------

V1_MEMORY = Path("/sys/fs/cgroup/memory")


@pytest.mark.skipif(os.geteuid() != 0 or not (V1_MEMORY / "memory.limit_in_bytes").exists(),
                    reason="needs root and a cgroup v1 memory controller at /sys/fs/cgroup/memory")
def test_real_cgroup_v1_limit_is_found_from_inside_it():
    group = V1_MEMORY / f"colibri-test-limit-{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(300 * MiB))

        def enter() -> None:
            (group / "cgroup.procs").write_text(str(os.getpid()))

        script = ("from colibrid.system.cgroup_memory import memory_limit; l = memory_limit(); "
                  "print(l.cgroup, l.limit_file, l.limit_bytes, l.usage_bytes)")
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                             preexec_fn=enter, check=True).stdout.split()
    finally:
        group.rmdir()
    assert out[0].endswith(f"/colibri-test-limit-{os.getpid()}")
    assert out[1:3] == ["memory.limit_in_bytes", str(300 * MiB)]
    assert 0 < int(out[3]) < 300 * MiB
