"""colibrid keeps within the memory it is given and never leaks hugepages: with the default
configuration inside a cgroup limit smaller than the pack it answers instead of being
OOM-killed, and says which limit it sized the cache from; whatever way a daemon ends (SIGKILL,
a served socket, a model that fails to load), vm.nr_hugepages ends where it started."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon.conftest import DaemonProcess
from tests.daemon.wire import WireClient

MiB = 1 << 20
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
V1_MEMORY = Path("/sys/fs/cgroup/memory")

needs_hugepage_control = pytest.mark.skipif(
    os.geteuid() != 0 or not os.access(NR_HUGEPAGES, os.W_OK), reason="changing vm.nr_hugepages needs root")


def nr_hugepages() -> int:
    return int(NR_HUGEPAGES.read_text())


def run_to_exit(pack: Path, socket_path: Path, *flags: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    """colibrid run until it exits by itself (for the starts that must fail)."""
    argv = [sys.executable, "-m", "colibrid", "--model", str(pack), "--socket", str(socket_path), *flags]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))


def ask_and_status(socket_path: Path) -> tuple[dict, dict]:
    with WireClient(socket_path, timeout_s=60.0) as client:
        client.hello()
        client.ask("a", max_tokens=8)
        _, end = client.collect("a")
        client.send({"op": "status", "id": "s"})
        return end, client.recv()


# ---- §4 memory limits ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pack_with_f32_experts(tmp_path_factory) -> Path:
    """The demo model with f32 experts: a ~50 MiB pack (48 MiB of experts) built in ~2 s."""
    out = tmp_path_factory.mktemp("f32-pack") / "f32.pack"
    subprocess.run([sys.executable, "-m", "colibrid.tools.demo", str(out), "--quant", "experts=f32", "--force"],
                   check=True, capture_output=True, timeout=120)
    return out


@pytest.fixture
def memory_cgroup():
    """A fresh cgroup v1 memory group; yields (its directory, a preexec_fn that enters it)."""
    if os.geteuid() != 0 or not (V1_MEMORY / "memory.limit_in_bytes").exists():
        pytest.skip("needs root and a cgroup v1 memory controller at /sys/fs/cgroup/memory")
    group = V1_MEMORY / f"colibri-test-{os.getpid()}"
    group.mkdir()

    def enter() -> None:
        (group / "cgroup.procs").write_text(str(os.getpid()))

    try:
        yield group, enter
    finally:
        group.rmdir()


@pytest.mark.parametrize("hugepages", ["default", "thp"])  # thp: the cache is charged to the limit, whoever runs it
def test_default_cache_size_under_a_cgroup_limit_below_the_pack_answers(pack_with_f32_experts, memory_cgroup,
                                                                         socket_dir, hugepages):
    group, enter = memory_cgroup
    pack_bytes = sum(f.stat().st_size for f in pack_with_f32_experts.iterdir())
    limit = (pack_bytes - 2 * MiB) // 4096 * 4096  # the kernel keeps whole pages
    (group / "memory.limit_in_bytes").write_text(str(limit))
    flags = () if hugepages == "default" else ("--hugepages", "thp")
    pool_before = nr_hugepages()

    daemon = DaemonProcess(pack_with_f32_experts, socket_dir / "colibrid.sock", *flags, preexec_fn=enter)
    try:
        end, status = ask_and_status(daemon.socket_path)
        pool_while_serving = nr_hugepages()
    finally:
        returncode, stderr = daemon.terminate()
    assert returncode == 0, f"colibrid ended with {returncode} (-9: OOM-killed):\n{stderr}"
    assert end["event"] == "done", end
    budget = status["memory_budget"]
    assert budget["cgroup_limit_bytes"] == limit
    assert budget["basis"].startswith(f"cgroup v1 /{group.name}: memory.limit_in_bytes")
    assert budget["available_bytes"] < limit and budget["cache_bytes"] <= budget["available_bytes"] // 2
    assert "not charged to the cgroup v1 memory limit" in budget["hugetlb"]
    assert "of the memory budget" in stderr and f"cgroup v1 /{group.name}" in stderr  # the startup log says it too
    assert pool_while_serving == pool_before, "hugetlb pages escape the limit: vm.nr_hugepages must not be raised"


# ---- §5 hugepages never leak -------------------------------------------------------------------


@needs_hugepage_control
def test_hugepages_of_a_killed_daemon_are_given_back_by_the_next_one(demo_pack, socket_dir):
    before = nr_hugepages()
    record = socket_dir / "hugepages.json"
    flags = ("--hugepages", str(before + 3), "--hugepage-record", str(record))
    killed = DaemonProcess(demo_pack, socket_dir / "colibrid.sock", *flags)
    assert nr_hugepages() >= before + 3
    killed.proc.send_signal(signal.SIGKILL)
    killed.proc.wait(20)
    killed.proc.stderr.close()
    assert nr_hugepages() >= before + 3  # nobody gave them back

    again = DaemonProcess(demo_pack, socket_dir / "colibrid.sock", *flags)
    returncode, stderr = again.terminate()
    assert returncode == 0, stderr
    assert "raised and never returned" in stderr and f"pid {killed.proc.pid}" in stderr
    assert nr_hugepages() == before
    assert not record.exists()


@needs_hugepage_control
def test_a_second_daemon_on_a_served_socket_never_touches_vm_nr_hugepages(start_daemon, demo_pack, socket_dir):
    first = start_daemon("--hugepages", "off")
    before = nr_hugepages()
    second = run_to_exit(demo_pack, first.socket_path, "--hugepages", str(before + 3),
                         "--hugepage-record", str(socket_dir / "hugepages.json"))
    assert second.returncode == 1
    assert "already serving" in second.stderr
    assert "vm.nr_hugepages" not in second.stderr, second.stderr
    assert nr_hugepages() == before
    with WireClient(first.socket_path) as client:  # the first one is unharmed
        assert client.hello()["event"] == "hello"


@needs_hugepage_control
def test_a_model_that_fails_to_load_gives_back_the_hugepages_raised_for_it(demo_pack, socket_dir):
    broken = socket_dir / "broken.pack"
    shutil.copytree(demo_pack, broken)
    (broken / "tokenizer.json").unlink()  # the pack opens and the cache is built; the engine then fails
    before = nr_hugepages()
    result = run_to_exit(broken, socket_dir / "colibrid.sock", "--hugepages", str(before + 3),
                         "--hugepage-record", str(socket_dir / "hugepages.json"))
    assert result.returncode == 1 and "tokenizer" in result.stderr, result.stderr
    assert nr_hugepages() == before
    assert not (socket_dir / "hugepages.json").exists()
