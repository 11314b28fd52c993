"""Running a process inside a memory limit: a child of the cgroup v1 memory controller, and the
page-cache eviction that makes what a run reads count against its own limit. Shared by
bench_aepc.py (`versus`, `run --cgroup-limit`) and bench_serving.py."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
# What a Colibri process needs besides its dense weights, the expert cache (and, for the
# daemon, its sequences' KV caches): the interpreter, numpy, tokenizers, libcolibri, logits.
# An assumption, used by bench_serving.py only: bench_aepc.py versus measures it instead
# (bench/versus_memory.py; about 56 MiB besides dense on the OLMoE-shaped pack). The headroom
# keeps the cgroup from reclaiming the pages Colibri uses (it reclaims llama.cpp's, which is
# the point of the comparison).
PROCESS_ALLOWANCE_BYTES = 512 << 20


def evict_from_page_cache(path: Path) -> None:
    """Evicts a file from the page cache, so that the pages a run faults in are charged to its
    cgroup (page cache is charged to whoever reads it first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def drop_from_page_cache(pack_path: Path) -> None:
    for name in ("dense.bin", "experts.bin"):
        evict_from_page_cache(Path(pack_path) / name)


class MemoryCgroup:
    """A new child of the v1 memory controller limited to ``limit_bytes`` (page cache included).
    Processes join it with ``Popen(..., preexec_fn=group.join)``; ``remove()`` deletes it once
    they have exited. A context manager."""

    def __init__(self, limit_bytes: int, name: str | None = None) -> None:
        self.limit_bytes = limit_bytes
        self.path = CGROUP_ROOT / (name or f"colibri-bench-{os.getpid()}")
        self.path.mkdir()
        (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))

    def join(self) -> None:
        """Moves the calling process into the group: a preexec_fn, run in the child before exec."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def usage(self) -> dict:
        """Peak usage and how often the limit was hit, since the group was made."""
        return {"limit_bytes": self.limit_bytes,
                "peak_bytes": int((self.path / "memory.max_usage_in_bytes").read_text()),
                "limit_hits": int((self.path / "memory.failcnt").read_text())}

    def remove(self) -> None:
        """rmdir, retried for 5 s: the kernel refuses while an exited member is still being reaped."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)

    def __enter__(self) -> "MemoryCgroup":
        return self

    def __exit__(self, *exc_info) -> None:
        self.remove()


def run_in_memory_cgroup(limit_bytes: int, argv: list[str], capture: bool = False) -> dict:
    """Runs ``argv`` in a new memory cgroup limited to ``limit_bytes``: its exit code, peak
    usage, how often it hit the limit and (with ``capture``) its stdout. The cgroup is removed
    afterwards."""
    from colibrid.sizes import format_bytes

    with MemoryCgroup(limit_bytes) as group:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE if capture else None, text=True, preexec_fn=group.join)
        stdout, _ = proc.communicate()
        result = {"code": proc.returncode, "stdout": stdout, **group.usage()}
        print(f"cgroup {group.path.name}: limit {format_bytes(limit_bytes)}, peak usage "
              f"{format_bytes(result['peak_bytes'])}, limit hit {result['limit_hits']} times, exit code "
              f"{result['code']}", flush=True)
        return result
