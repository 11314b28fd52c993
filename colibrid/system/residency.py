"""How much of this process is resident, measured rather than assumed.

    resident_bytes(array)    the bytes of ``array``'s pages that are in memory now (mincore,
                             colibrid.native.residency)
    process_rss_bytes()      this process' resident set (VmRSS), in bytes
"""

from __future__ import annotations

import os

from colibrid.native.residency import resident_bytes

__all__ = ["process_rss_bytes", "resident_bytes"]


def process_rss_bytes() -> int:
    """This process' resident set size (VmRSS of /proc/self/status), in bytes. Hugetlb pages
    are not part of it (the kernel counts them apart)."""
    with open(f"/proc/{os.getpid()}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0
