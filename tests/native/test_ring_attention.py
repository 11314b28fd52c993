"""Sliding-window and chunked-local attention over a ring buffer (libcolibri's col_attention
and col_attention_block with a ring): the same numbers, bit for bit, as over a flat cache
holding every key, while the ring holds only span + step - 1 rows."""

from __future__ import annotations

import numpy as np
import pytest

from colibrid import native
from colibrid.native import TensorType

D, H, K, HD = 64, 4, 2, 16


def gaussian(shape, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _masked_softmax_attention(q, keys, values, positions, window, chunk):
    """float64 reference: query t sees key j <= p, within the window and from its chunk's start."""
    n_q, S = q.shape[0], keys.shape[0]
    j, p = np.arange(S)[None, :], positions[:, None]
    visible = j <= p
    if window:
        visible &= j > p - window
    if chunk:
        visible &= j >= p - p % chunk
    qg = q.reshape(n_q, K, H // K, HD).astype(np.float64)
    scores = np.einsum("tkgd,skd->kgts", qg, keys) * HD ** -0.5 + np.where(visible, 0.0, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("kgts,skd->tkgd", probs, values).reshape(n_q, H * HD)


def _ring_of(keys, rows, upto):
    """The ring a cache of ``rows`` rows holds after keys 0 .. upto - 1 were written in order."""
    ring = np.zeros((rows,) + keys.shape[1:], np.float32)
    for p in range(upto):
        ring[p % rows] = keys[p]
    return ring


@pytest.mark.parametrize("window, chunk", [(None, 4), (5, None), (6, 4)])
def test_attention_with_a_chunk_or_window_matches_the_masked_softmax(window, chunk, pools):
    S, n_q = 13, 5
    keys, values, q = gaussian((S, K, HD), 1), gaussian((S, K, HD), 2), gaussian((n_q, H, HD), 3)
    positions = np.arange(S - n_q, S)
    want = _masked_softmax_attention(q, keys, values, positions, window, chunk)
    flat = native.attention(q, keys, values, positions, window, HD ** -0.5, chunk=chunk, pool=pools[2])
    np.testing.assert_allclose(flat, want, rtol=1e-5, atol=1e-5)
    rows = min(s for s in (window, chunk) if s) + n_q - 1  # the smallest ring that holds them
    ring = native.attention(q, _ring_of(keys, rows, S), _ring_of(values, rows, S), positions, window, HD ** -0.5,
                            chunk=chunk, ring=True, pool=pools[2])
    np.testing.assert_array_equal(ring, flat)


def _layer(window, chunk, qkv_type=TensorType.Q8_0):
    w = {name: native.quantize(qkv_type, gaussian(shape, 10 + i, 0.2))
         for i, (name, shape) in enumerate((("wq", (H * HD, D)), ("wk", (K * HD, D)), ("wv", (K * HD, D)), ("wo", (D, H * HD))))}
    norm = 1.0 + gaussian((D,), 20, 0.1)
    return native.attention_layer(D, H, K, HD, norm, qkv_type, w["wq"], w["wk"], w["wv"], qkv_type, w["wo"], eps=1e-5,
                                  scale=HD ** -0.5, window=window, chunk=chunk)


@pytest.mark.parametrize("window, chunk", [(5, None), (None, 4), (7, 3)])
def test_attention_block_over_a_ring_equals_a_flat_cache(window, chunk, kernel_level, pools):
    """Steps of 1 to 3 tokens over 30 positions (the ring wraps several times): every step's
    output equals the flat cache's bit for bit, on every kernel level and thread count."""
    layer, max_step = _layer(window, chunk), 3
    rows = min(s for s in (window, chunk) if s) + max_step - 1
    steps = [3, 1, 2, 1, 3, 3, 1, 1, 2, 3, 1, 2, 3, 1, 3]
    total = sum(steps)
    angles = gaussian((total, HD), 30)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    for level in native.supported_kernels():
        kernel_level(level)
        for n in (1, 2, 3):
            flat = [np.zeros((total, K, HD), np.float32) for _ in range(2)]
            ring = [np.zeros((rows, K, HD), np.float32) for _ in range(2)]
            start = 0
            for i, T in enumerate(steps):
                x = gaussian((T, D), 100 + i)
                a, b = x.copy(), x.copy()
                native.attention_block(layer, a, cos[start:start + T], sin[start:start + T], *flat, start, pool=pools[n])
                native.attention_block(layer, b, cos[start:start + T], sin[start:start + T], *ring, start, pool=pools[n],
                                       ring=True)
                np.testing.assert_array_equal(b, a, err_msg=f"{level}, {n} threads, step {i} at {start}")
                start += T
            np.testing.assert_array_equal(ring[0], _ring_of(flat[0], rows, total))


def test_a_ring_too_small_for_the_step_is_refused():
    layer = _layer(5, None)
    x = gaussian((3, D), 1)
    cos, sin = np.ones((3, HD), np.float32), np.zeros((3, HD), np.float32)
    small = [np.zeros((6, K, HD), np.float32) for _ in range(2)]  # 5 + 3 - 1 = 7 rows needed
    with pytest.raises(native.InvalidArgumentError, match="7"):
        native.attention_block(layer, x, cos, sin, *small, 10, ring=True)
    assert native._lib().col_attention_block(None, native.ctypes.addressof(layer), x.ctypes.data, 3, cos.ctypes.data,
                                             sin.ctypes.data, small[0].ctypes.data, small[1].ctypes.data, 10, 6) == 1
    full_layer = _layer(None, None)  # a ring needs a window or a chunk
    with pytest.raises(native.InvalidArgumentError, match="window or a chunk"):
        native.attention_block(full_layer, x, cos, sin, *[np.zeros((64, K, HD), np.float32)] * 2, 0, ring=True)
    assert not small[0].any()
