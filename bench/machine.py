"""The machine a number was measured on: its CPU model, and its memory read bandwidth measured
in the same run (the roofline's numerator). Every benchmark names both next to its numbers."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def cpu_model() -> str:
    """The CPU as /proc/cpuinfo names it ("AMD EPYC (family 26, model 2; 2 CPUs)"): the model
    name alone may be as vague as "AMD EPYC" on a virtual machine, the family and model say
    which generation it is. The CPUs are those we may run on."""
    import os

    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
            if not line.strip():  # the first CPU's block is enough
                break
    except OSError:
        pass
    return (f"{fields.get('model name', 'unknown CPU')} (family {fields.get('cpu family', '?')}, model "
            f"{fields.get('model', '?')}; {len(os.sched_getaffinity(0))} CPUs)")


def memory_bandwidth(threads: int, runs: int = 3) -> float:
    """Read bandwidth in GB/s with ``threads`` readers: the best of ``runs`` runs of
    bench/membw.c (each the best of 5 passes over 2 GiB)."""
    binary = Path("/tmp/colibri-membw")
    source = REPO / "bench" / "membw.c"
    if not binary.exists() or binary.stat().st_mtime < source.stat().st_mtime:
        subprocess.run(["cc", "-O2", "-mavx2", "-pthread", str(source), "-o", str(binary)], check=True)
    return max(float(subprocess.run([str(binary), str(threads)], check=True, capture_output=True, text=True).stdout)
               for _ in range(runs))
