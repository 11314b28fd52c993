"""Status' split of the daemon's resident memory (``memory`` in the status event).

    ResidentSplit(engine).split(kv, prefix)  ->  the keys below, merged into ``memory``

    rss_bytes                     the daemon's resident set (VmRSS)
    dense_resident_bytes          pages of dense.bin's buffer in memory (mincore; normally all)
    expert_cache_resident_bytes   pages of the expert cache's slab in memory (mincore; all of
                                  it when locked)
    expert_cache_in_rss           false when the slab is hugetlb pages, which rss does not
                                  count: they are then not taken from rss
    kv_in_use_bytes               the KV reservations of the running requests (the batch's)
    prefix_cache_in_use_bytes     the kept prefix states (the prefix cache's counter)
    rest_bytes                    rss minus the parts above that rss holds, never below 0:
                                  Python, numpy, the tokenizer, scratch, outboxes

The KV buffers are np.empty and reserved whole, so a reservation can be larger than what is
resident; rest is then understated by the difference (it is clamped at 0, not negative).
The mincore walk of a large buffer costs milliseconds: the split is kept for a second, so
`colibrictl top` polling status does not pay it each time.
"""

from __future__ import annotations

import time

from colibrid.native.residency import resident_bytes
from colibrid.system.residency import process_rss_bytes

KEEP_S = 1.0  # how long one measurement of the big buffers is reused


class ResidentSplit:
    """The split of one daemon's resident memory, its big buffers measured at most once a
    ``keep_s``."""

    def __init__(self, engine, keep_s: float = KEEP_S) -> None:
        self.engine, self.keep_s = engine, keep_s
        self._measured_s = -float("inf")
        self._buffers = {"dense": 0, "expert_cache": 0, "expert_cache_in_rss": True}

    def _measure_buffers(self) -> dict:
        now = time.monotonic()
        if now - self._measured_s >= self.keep_s:
            buffers = self.engine.resident_buffers()
            self._buffers = {"dense": max(resident_bytes(buffers["dense"]), 0),
                             "expert_cache": max(resident_bytes(buffers["expert_cache"]), 0),
                             "expert_cache_in_rss": not buffers["expert_cache_hugetlb"]}
            self._measured_s = now
        return self._buffers

    def split(self, kv_in_use_bytes: int, prefix_cache_in_use_bytes: int) -> dict:
        """The split, given the KV and prefix-cache bytes in use: the status reports those
        counters itself, so they are read once, for both."""
        rss = process_rss_bytes()
        buffers = self._measure_buffers()
        kv, prefix = kv_in_use_bytes, prefix_cache_in_use_bytes
        in_rss = buffers["dense"] + (buffers["expert_cache"] if buffers["expert_cache_in_rss"] else 0) + kv + prefix
        return {"rss_bytes": rss, "dense_resident_bytes": buffers["dense"],
                "expert_cache_resident_bytes": buffers["expert_cache"],
                "expert_cache_in_rss": buffers["expert_cache_in_rss"],
                "kv_in_use_bytes": kv, "prefix_cache_in_use_bytes": prefix,
                "rest_bytes": max(rss - in_rss, 0)}
