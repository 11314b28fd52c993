"""col_mla_block, the one-call latent attention step (DeepSeek-V2/V3), against a float64
numpy reference written the way transformers computes it: the expanded form (per-head keys
kv_b_k @ latent and values kv_b_v @ latent), interleaved RoPE pairs, a latent cache of C + R
floats per token. On every kernel level, for 1, 2 and 3 threads (bit-identical), with and
without q's low-rank path, for f32, q8_0 and q4_g64 weights; a prompt in one call and the
same tokens one call each give the same bits.

Tolerances (relative to max |reference|): portable and f32 weights 1e-5 (float32 sums in
another order: the absorbed form sums over the latent, the reference over head dims); SIMD
levels with q8_0 / q4_g64 weights quantize the activations of each product to int8 (o_lat
too, before kv_b's value rows), 3e-2.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibrid import native
from colibrid.native import TensorType

D, H, C, N, R, VD = 64, 4, 64, 32, 16, 32
L = C + R


def _gauss(shape, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _weights(q_rank: int, type_: TensorType, seed: int = 0) -> dict:
    """Random weights as (type, encoded bytes, dequantized float64) per matrix, norms as float32."""
    shapes = {"kv_a": (L, D), "kv_b": (H * (N + VD), C), "o": (D, H * VD)}
    shapes.update({"q_a": (q_rank, D), "q_b": (H * (N + R), q_rank)} if q_rank else {"q": (H * (N + R), D)})
    out = {}
    for i, (name, (rows, cols)) in enumerate(sorted(shapes.items())):
        w = _gauss((rows, cols), seed + i, 0.3 / np.sqrt(cols) * 4)
        packed = native.quantize(type_, w)
        out[name] = (type_, packed, native.dequantize(type_, packed, rows, cols).astype(np.float64))
    out["norm"] = 1 + 0.2 * _gauss((D,), seed + 10)
    out["kv_a_norm"] = 1 + 0.2 * _gauss((C,), seed + 11)
    if q_rank:
        out["q_a_norm"] = 1 + 0.2 * _gauss((q_rank,), seed + 12)
    return out


def _rms(x, w, eps=1e-5):
    return w * (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps))


def _rope_interleaved(x, cos, sin):
    """transformers' apply_rotary_pos_emb_interleave: pairs (x0, x1), (x2, x3) ..., output
    de-interleaved; x (T, ..., R), cos/sin (T, R) with the two halves equal."""
    half = x.shape[-1] // 2
    c = cos[:, :half].reshape((x.shape[0],) + (1,) * (x.ndim - 2) + (half,))
    s = sin[:, :half].reshape(c.shape)
    a, b = x[..., 0::2], x[..., 1::2]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def _rope_half(x, cos, sin):
    half = x.shape[-1] // 2
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (x.shape[-1],)
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos.reshape(shape) + rotated * sin.reshape(shape)


def reference(w: dict, x: np.ndarray, cos, sin, interleaved: bool, scale: float):
    """(x + attention, latent cache (T, L)) for a fresh sequence, expanded form, float64."""
    rope = _rope_interleaved if interleaved else _rope_half
    x64 = x.astype(np.float64)
    T = x.shape[0]
    h = _rms(x64, w["norm"])
    if "q_a" in w:
        q = _rms(h @ w["q_a"][2].T, w["q_a_norm"]) @ w["q_b"][2].T
    else:
        q = h @ w["q"][2].T
    q = q.reshape(T, H, N + R)
    q_nope, q_rope = q[..., :N], rope(q[..., N:], cos, sin)
    kv = h @ w["kv_a"][2].T
    latent, k_rope = _rms(kv[:, :C], w["kv_a_norm"]), rope(kv[:, C:], cos, sin)  # (T, C), (T, R)
    kvb = (latent @ w["kv_b"][2].T).reshape(T, H, N + VD)
    keys = np.concatenate([kvb[..., :N], np.broadcast_to(k_rope[:, None, :], (T, H, R))], axis=-1)  # (S, H, N + R)
    values = kvb[..., N:]  # (S, H, Vd)
    query = np.concatenate([q_nope, q_rope], axis=-1)
    scores = np.einsum("thd,shd->hts", query, keys) * scale
    scores = np.where(np.tril(np.ones((T, T), bool))[None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    a = np.einsum("hts,shd->thd", p, values).reshape(T, H * VD)
    return x64 + a @ w["o"][2].T, np.concatenate([latent, k_rope], axis=-1)


def _tables(T, seed=3):
    from colibrid.engine.forward.rope import Rotary
    from colibrid.models.model_config import RopeConfig

    return Rotary(RopeConfig(theta=10000.0), R).cos_sin(np.arange(T))


def _layer(w: dict, q_rank: int, interleaved: bool, scale: float):
    mats = {k: (v[0], v[1]) for k, v in w.items() if isinstance(v, tuple)}
    mats.update({k: w[k] for k in ("kv_a_norm", "q_a_norm") if k in w})
    return native.mla_layer(D, H, q_rank, C, N, R, VD, w["norm"], mats, eps=1e-5, scale=scale,
                            rope_interleaved=interleaved)


CASES = [(32, TensorType.F32, True), (0, TensorType.F32, False), (32, TensorType.Q8_0, True), (0, TensorType.Q8_0, True),
         (64, TensorType.Q4_G64, True)]


@pytest.mark.parametrize("q_rank, type_, interleaved", CASES, ids=lambda v: getattr(v, "name_in_pack", str(v)))
def test_mla_block_matches_the_expanded_reference(q_rank, type_, interleaved, kernel_level, pools):
    T, scale = 7, (N + R) ** -0.5 * 1.3
    w = _weights(q_rank, type_)
    x = _gauss((T, D), 20)
    cos, sin = _tables(T)
    want_x, want_cache = reference(w, x, cos, sin, interleaved, scale)
    layer = _layer(w, q_rank, interleaved, scale)
    for level in native.supported_kernels():
        kernel_level(level)
        results = []
        for n in (1, 2, 3):
            got, cache = x.copy(), np.full((T + 3, L), 7.0, np.float32)
            native.mla_block(layer, got, cos, sin, cache, 0, pool=pools[n])
            assert np.all(cache[T:] == 7.0)  # rows past the new tokens untouched
            results.append((got, cache[:T]))
        for got, cache in results[1:]:
            np.testing.assert_array_equal(got, results[0][0])
            np.testing.assert_array_equal(cache, results[0][1])
        got, cache = results[0]
        limit = 3e-2 if level != "portable" and type_ is not TensorType.F32 else 1e-5
        # the cache holds the latent and the rope key: the same values as the reference's
        np.testing.assert_allclose(cache, want_cache, atol=limit * np.abs(want_cache).max(), err_msg=level)
        delta, want_delta = got - x, want_x - x
        assert np.abs(delta - want_delta).max() <= limit * np.abs(want_delta).max(), level


@pytest.mark.parametrize("q_rank, type_", [(32, TensorType.F32), (0, TensorType.Q8_0), (64, TensorType.Q4_G64)])
def test_a_prompt_in_one_call_equals_one_token_per_call(q_rank, type_, kernel_level):
    """Prefill and decode run the same absorbed form: the same bits either way."""
    T, scale = 6, (N + R) ** -0.5
    w = _weights(q_rank, type_, seed=5)
    layer = _layer(w, q_rank, True, scale)
    x = _gauss((T, D), 21)
    cos, sin = _tables(T)
    for level in native.supported_kernels():
        kernel_level(level)
        whole, cache_whole = x.copy(), np.zeros((T, L), np.float32)
        native.mla_block(layer, whole, cos, sin, cache_whole, 0)
        steps, cache_steps = x.copy(), np.zeros((T, L), np.float32)
        native.mla_block(layer, steps[:2], cos[:2], sin[:2], cache_steps, 0)
        for t in range(2, T):
            row = steps[t:t + 1]  # a view: updated in place
            native.mla_block(layer, row, cos[t:t + 1], sin[t:t + 1], cache_steps, t)
        np.testing.assert_array_equal(steps, whole, err_msg=level)
        np.testing.assert_array_equal(cache_steps, cache_whole, err_msg=level)


def test_mla_layer_struct_matches_c():
    assert native.ctypes.sizeof(native.MlaLayer) == native._lib().col_mla_layer_size()


def test_mla_block_rejects_bad_arguments():
    w = _weights(0, TensorType.F32)
    layer = _layer(w, 0, True, 0.1)
    x = _gauss((2, D), 1)
    cos, sin = _tables(2)
    with pytest.raises(native.InvalidArgumentError):
        native.mla_block(layer, x, cos, sin, np.zeros((1, L), np.float32), 0)  # cache too short
    with pytest.raises(native.InvalidArgumentError):
        native.mla_block(layer, x, cos[:, :4], sin, np.zeros((2, L), np.float32), 0)
    with pytest.raises(native.InvalidArgumentError, match="bytes"):
        bad = {k: (v[0], v[1]) for k, v in w.items() if isinstance(v, tuple)}
        bad["kv_b"] = (TensorType.F32, np.zeros(10, np.float32))
        native.mla_layer(D, H, 0, C, N, R, VD, w["norm"], {**bad, "kv_a_norm": w["kv_a_norm"]}, eps=1e-5, scale=0.1,
                         rope_interleaved=True)
