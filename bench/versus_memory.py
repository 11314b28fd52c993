"""How `bench_aepc.py versus` sizes Colibri's expert cache under the memory limit, and what it
says when the limit is too small: measured, not assumed.

The cache is what the limit leaves after the Colibri process' own non-cache resident bytes,
measured by a short probe run of the same process (`bench_aepc.py run` with a cache of a few
slots reports them as ``noncache_peak_bytes``: dense weights, interpreter, numpy, the decode's
temporaries), the KV cache of the real run's longer context (the probe's is shorter), and
VERSUS_MARGIN_BYTES.
"""

from __future__ import annotations

from colibrid.sizes import format_bytes

# Kept free under the limit beyond the measured non-cache bytes and the KV cache: what a
# longer decode leaves in the allocator's free lists (the daemon's rest varies by ~45 MiB
# between requests, docs/architecture.md "Memory") and the page cache the cgroup is charged
# for while dense.bin is read (dropped chunk by chunk).
VERSUS_MARGIN_BYTES = 64 << 20


class LimitTooSmall(SystemExit):
    """The limit leaves no room for a cache that can serve one layer: the message says why."""


def kv_cache_bytes(num_layers: int, kv_heads: int, head_dim: int, context_tokens: int) -> int:
    """Float32 keys and values of full attention for ``context_tokens`` (what the run reserves)."""
    return 2 * num_layers * kv_heads * head_dim * 4 * context_tokens


def versus_cache_bytes(limit: int, noncache_bytes: int, kv_bytes: int, slot_bytes: int, min_slots: int,
                       margin: int = VERSUS_MARGIN_BYTES) -> int:
    """The expert cache for ``limit``: limit - non-cache - KV - margin, whole slots; at least
    ``min_slots`` (one layer's top-k, pinned at once) or LimitTooSmall."""
    room = limit - noncache_bytes - kv_bytes - margin
    slots = max(room, 0) // slot_bytes
    if slots < min_slots:
        raise LimitTooSmall(
            f"the memory limit {format_bytes(limit)} is too small for Colibri: its process needs "
            f"{format_bytes(noncache_bytes)} besides the expert cache (measured: dense weights, interpreter, "
            f"decode), {format_bytes(kv_bytes)} of KV cache and a {format_bytes(margin)} margin, which leaves "
            f"{format_bytes(max(room, 0))}: fewer than the {min_slots} expert slots of "
            f"{format_bytes(slot_bytes)} one layer needs at once ({format_bytes(min_slots * slot_bytes)}); "
            f"raise the limit to at least {format_bytes(limit - room + min_slots * slot_bytes)}")
    return int(slots * slot_bytes)


def oom_message(limit: int, dense_bytes: int, noncache_bytes: int, kv_bytes: int, cache_bytes: int,
                usage: dict) -> str:
    """What to say when the cgroup's OOM killer ended the Colibri run: the limit and what the
    process was sized to need, so the defect in the sizing shows."""
    rest = noncache_bytes - dense_bytes
    needed = noncache_bytes + kv_bytes + cache_bytes
    return (f"the Colibri run was killed by the cgroup's OOM killer (a bench defect: its cache was sized to fit). "
            f"Limit {format_bytes(limit)}; sized to need {format_bytes(needed)} = dense {format_bytes(dense_bytes)} "
            f"+ expert cache {format_bytes(cache_bytes)} + measured rest {format_bytes(rest)} + KV "
            f"{format_bytes(kv_bytes)}, with {format_bytes(limit - needed)} to spare; peak usage "
            f"{format_bytes(usage.get('peak_bytes', 0))}, limit hit {usage.get('limit_hits', 0)} times. "
            f"The process grew beyond its measured rest: rerun with --limit higher, and report it")
