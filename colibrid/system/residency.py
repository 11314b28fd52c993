"""How much of this process is resident, as the kernel counts it (VmRSS). What of one buffer
is resident is colibrid.native.resident_bytes (mincore)."""

from __future__ import annotations

import os


def process_rss_bytes() -> int:
    """This process' resident set size (VmRSS of /proc/self/status), in bytes. Hugetlb pages
    are not part of it (the kernel counts them apart)."""
    with open(f"/proc/{os.getpid()}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0
