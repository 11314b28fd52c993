"""bench_aepc.py versus: Colibri's cache sized from the limit and the measured non-cache bytes,
and the message when it does not fit (bench/versus_memory.py), without running the bench."""

from __future__ import annotations

import pytest

from tests.bench.bench_modules import load_bench_module

versus = load_bench_module("versus_memory")
MIB = 1 << 20


def test_the_cache_is_the_limit_less_what_was_measured_in_whole_slots():
    cache = versus.versus_cache_bytes(limit=3000 * MIB, noncache_bytes=560 * MIB, kv_bytes=22 * MIB,
                                      slot_bytes=6 * MIB, min_slots=8)
    room = 3000 * MIB - 560 * MIB - 22 * MIB - versus.VERSUS_MARGIN_BYTES
    assert cache == room // (6 * MIB) * 6 * MIB
    assert room - 6 * MIB < cache <= room


def test_a_limit_that_leaves_less_than_one_layer_of_slots_is_refused_with_the_numbers():
    with pytest.raises(versus.LimitTooSmall) as refused:
        versus.versus_cache_bytes(limit=640 * MIB, noncache_bytes=560 * MIB, kv_bytes=22 * MIB,
                                  slot_bytes=6 * MIB, min_slots=8)
    message = str(refused.value)
    assert "640.0 MiB is too small" in message and "560.0 MiB besides the expert cache" in message
    assert "8 expert slots" in message
    # the limit it names is enough
    needed = 560 * MIB + 22 * MIB + versus.VERSUS_MARGIN_BYTES + 8 * 6 * MIB
    assert versus.versus_cache_bytes(needed, 560 * MIB, 22 * MIB, 6 * MIB, 8) == 8 * 6 * MIB
    with pytest.raises(versus.LimitTooSmall):
        versus.versus_cache_bytes(needed - 1, 560 * MIB, 22 * MIB, 6 * MIB, 8)


def test_the_oom_message_names_the_limit_and_each_part_needed():
    message = versus.oom_message(limit=3072 * MIB, dense_bytes=489 * MIB, noncache_bytes=545 * MIB,
                                 kv_bytes=22 * MIB, cache_bytes=2300 * MIB,
                                 usage={"peak_bytes": 3000 * MIB, "limit_hits": 150})
    assert "OOM killer" in message and "Limit 3.0 GiB" in message
    assert "dense 489.0 MiB" in message and "expert cache 2.2 GiB" in message
    assert "measured rest 56.0 MiB" in message and "KV 22.0 MiB" in message
    assert "limit hit 150 times" in message


def test_kv_cache_bytes_are_float32_keys_and_values():
    assert versus.kv_cache_bytes(num_layers=16, kv_heads=16, head_dim=128, context_tokens=88) == 2 * 16 * 16 * 128 * 4 * 88
