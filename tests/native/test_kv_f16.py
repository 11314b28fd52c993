"""A float16 KV cache (col_attention_seq's kv_type): each new key and value is rounded to
float16 as it is stored, and a step then gives, bit for bit, what a float32 cache holding the
same rounded values gives, on every kernel level, thread count and cache shape."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from colibrid import native
from colibrid.native import TensorType
from colibrid.native.layer_steps import AttentionSeq

D, H, K = 64, 4, 2


def gaussian(shape, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _layer(head_dim, *, window=None, exact_kv=False):
    """With ``exact_kv`` the new keys and values are the biases bk and bv exactly (zero wk and
    wv, no RoPE), values float16 holds, so a float32 cache stores what a float16 one does."""
    q_rows, kv_rows = H * head_dim, K * head_dim
    shapes = {"wq": (q_rows, D), "wk": (kv_rows, D), "wv": (kv_rows, D), "wo": (D, q_rows)}
    w = {name: gaussian(shape, 10 + i, 0.2) for i, (name, shape) in enumerate(shapes.items())}
    extra = {}
    if exact_kv:
        w["wk"], w["wv"] = np.zeros_like(w["wk"]), np.zeros_like(w["wv"])
        extra = dict(bk=gaussian((kv_rows,), 30).astype(np.float16).astype(np.float32),
                     bv=gaussian((kv_rows,), 31).astype(np.float16).astype(np.float32), no_rope=True)
    o_type = TensorType.Q8_0 if q_rows % 32 == 0 else TensorType.F32  # a row of wo is H * head_dim wide
    w = {name: native.quantize(o_type if name == "wo" else TensorType.Q8_0, m) for name, m in w.items()}
    return native.attention_layer(D, H, K, head_dim, 1.0 + gaussian((D,), 20, 0.1), TensorType.Q8_0, w["wq"], w["wk"],
                                  w["wv"], o_type, w["wo"], eps=1e-5, scale=head_dim ** -0.5, window=window, **extra)


def _rope(total, head_dim):
    angles = gaussian((total, head_dim), 40)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


@pytest.mark.parametrize("head_dim, window", [(16, None), (12, None), (128, None), (256, None), (16, 7)])
def test_a_float16_cache_reads_as_the_float32_cache_of_its_values(head_dim, window, kernel_level, pools):
    """head_dim 12 takes the values' axpy path, 16 and 128 the values in registers, 256 a
    converted tile of 32 keys (so a query's keys span several tiles), window 7 a ring."""
    layer, steps = _layer(head_dim, window=window, exact_kv=True), [5, 1, 3, 1, 2, 1]
    n_past, total = 40, 40 + sum(steps)
    rows = window + max(steps) - 1 if window else total
    past = [gaussian((rows, K, head_dim), 50 + i).astype(np.float16) for i in range(2)]  # keys before the steps
    cos, sin = _rope(total, head_dim)
    for level in native.supported_kernels():
        kernel_level(level)
        for n in (1, 2):
            half = [p.copy() for p in past]
            full = [p.astype(np.float32) for p in past]
            start = n_past
            for i, T in enumerate(steps):
                x = gaussian((T, D), 100 + i)
                a, b = x.copy(), x.copy()
                rope = cos[start:start + T], sin[start:start + T]
                native.attention_block(layer, a, *rope, *full, start, pool=pools[n], ring=bool(window))
                native.attention_block(layer, b, *rope, *half, start, pool=pools[n], ring=bool(window))
                np.testing.assert_array_equal(b, a, err_msg=f"{level}, {n} threads, step {i} at {start}")
                start += T
            for f, h in zip(full, half):
                np.testing.assert_array_equal(h.astype(np.float32), f)


def test_a_float16_cache_stores_keys_and_values_rounded_to_nearest_even(kernel_level, pools):
    head_dim, T = 16, 6
    layer, (cos, sin) = _layer(head_dim), _rope(T, head_dim)
    x = gaussian((T, D), 7)
    for level in native.supported_kernels():
        kernel_level(level)
        full = [np.zeros((T, K, head_dim), np.float32) for _ in range(2)]
        half = [np.zeros((T, K, head_dim), np.float16) for _ in range(2)]
        a, b = x.copy(), x.copy()
        native.attention_block(layer, a, cos, sin, *full, 0, pool=pools[2])
        native.attention_block(layer, b, cos, sin, *half, 0, pool=pools[2])
        for f, h in zip(full, half):  # numpy's astype rounds to nearest even, as the kernels must
            np.testing.assert_array_equal(h.view(np.uint16), f.astype(np.float16).view(np.uint16), err_msg=level)
        assert not np.array_equal(b, a)  # the keys did change ...
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-2 * np.abs(a).max())  # ... by float16's rounding


def test_a_batch_mixes_float16_and_float32_caches(pools):
    """Each sequence's rows get the bits they get alone, whatever the other's cache type."""
    head_dim = 16
    layer, (cos, sin) = _layer(head_dim), _rope(12, head_dim)
    x = gaussian((5, D), 3)  # 3 rows of the float16 sequence, then 2 of the float32 one
    caches = [[np.zeros((12, K, head_dim), dtype) for _ in range(2)] for dtype in (np.float16, np.float32)]
    alone = [x[:3].copy(), x[3:].copy()]
    native.attention_block(layer, alone[0], cos[:3], sin[:3], *[np.zeros_like(c) for c in caches[0]], 0, pool=pools[2])
    native.attention_block(layer, alone[1], cos[4:6], sin[4:6], *[np.zeros_like(c) for c in caches[1]], 4, pool=pools[2])
    batch_cos, batch_sin = np.concatenate([cos[:3], cos[4:6]]), np.concatenate([sin[:3], sin[4:6]])
    native.attention_block_batch(layer, x, batch_cos, batch_sin,
                                 [(*caches[0], 0, 3, False), (*caches[1], 4, 2, False)], pools[2])
    np.testing.assert_array_equal(x[:3], alone[0])
    np.testing.assert_array_equal(x[3:], alone[1])


def test_bad_float16_caches_are_refused():
    layer, (cos, sin) = _layer(16), _rope(2, 16)
    x = gaussian((2, D), 1)
    with pytest.raises(native.InvalidArgumentError, match="one type"):
        native.attention_block(layer, x, cos, sin, np.zeros((4, K, 16), np.float16), np.zeros((4, K, 16), np.float32), 0)
    with pytest.raises(native.InvalidArgumentError, match="float32 or float16"):
        native.attention_block(layer, x, cos, sin, *[np.zeros((4, K, 16), np.float64)] * 2, 0)
    wide = _layer(1026)
    with pytest.raises(native.InvalidArgumentError, match="at most 1024"):
        native.attention_block(wide, gaussian((1, D), 1), *_rope(1, 1026), *[np.zeros((1, K, 1026), np.float16)] * 2, 0)
    # The library checks the type itself: anything but float32 (0) and float16 (1) is refused.
    keys, vals = (np.zeros((4, K, 16), np.float32) for _ in range(2))
    for kv_type in (2, 3, -1):
        seq = AttentionSeq(keys=keys.ctypes.data, vals=vals.ctypes.data, n_past=0, n_tok=2, ring_rows=0, kv_type=kv_type)
        status = native._lib().col_attention_block_batch(None, ctypes.addressof(layer), x.ctypes.data, cos.ctypes.data,
                                                         sin.ctypes.data, ctypes.addressof(seq), 1)
        assert status == 1, kv_type  # COL_EINVAL
    assert not keys.any() and not vals.any()
