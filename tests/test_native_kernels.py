"""libcolibri's fast paths against its reference: SIMD kernel levels, the worker pool, the
fused expert call, RMSNorm, RoPE and attention.

Tolerances, stated once:
  - portable level: float32 activations, error <= 1e-5 x (|x| @ |w|^T) (as in test_native);
  - SIMD levels with q8_0 / q4_g64 weights quantize each block of activations to int8
    (blocks of 32 for q8_0, 64 for q4_g64: the weight's block), so each activation is off by
    at most max|x_block| / 254; the product is then off by at most
    sum_j |w_j| * max|x_block(j)| / 254, plus float rounding (1e-5 x scale);
  - SIMD levels among themselves share that quantization and sum exactly in integers: they
    agree to 1e-5 x scale;
  - the thread count never changes a result: every output element is computed by one
    thread with the same code, so results are bit-identical for 1, 2 or 3 threads.
"""

from __future__ import annotations

import numpy as np
import pytest

from colibrid import native
from colibrid.native import TensorType

SIMD_LEVELS = [level for level in native.supported_kernels() if level != "portable"]
QUANT_TYPES = [TensorType.Q8_0, TensorType.Q4_G64]

# (n_out, n_in in blocks of 64, n_tok): row counts not multiples of the 16-row tile nor of
# the thread split, odd numbers of 32-blocks (n_in = 64k is 2k blocks of 32; 32*odd below)
SHAPES = [(1, 1, 1), (7, 3, 1), (37, 5, 2), (100, 2, 3), (257, 7, 5), (33, 16, 1), (129, 32, 4)]


@pytest.fixture
def kernel_level():
    """Restores the active level after a test that switches it."""
    before = native.kernels()
    yield native.set_kernels
    native.set_kernels(before)


@pytest.fixture(scope="module")
def pools():
    made = {n: native.ThreadPool(n) for n in (1, 2, 3)}
    yield made
    for pool in made.values():
        pool.close()


def gaussian(shape, seed, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def activation_error_bound(w_deq: np.ndarray, x: np.ndarray, block: int) -> np.ndarray:
    """(T, O) bound of |x_int8 @ w^T - x @ w^T| from int8 activations in blocks of ``block``."""
    T, n_in = x.shape
    step = np.abs(x.reshape(T, n_in // block, block)).max(axis=2) / 254.0  # (T, nb) half a step
    w_abs = np.abs(w_deq.astype(np.float64)).reshape(w_deq.shape[0], n_in // block, block).sum(axis=2)  # (O, nb)
    return step @ w_abs.T


def _inputs(type_, shape, seed):
    n_out, n_in_64, n_tok = shape
    n_in = 64 * n_in_64 if type_ is TensorType.Q4_G64 else 32 * (2 * n_in_64 + 1)  # q8_0: odd block count
    w = gaussian((n_out, n_in), seed, 0.1)
    x = gaussian((n_tok, n_in), seed + 1)
    packed = native.quantize(type_, w)
    return packed, native.dequantize(type_, packed, n_out, n_in), x, n_out, n_in


@pytest.mark.skipif(not SIMD_LEVELS, reason="no SIMD kernel level on this CPU")
@pytest.mark.parametrize("type_", QUANT_TYPES, ids=lambda t: t.name_in_pack)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_simd_matmul_equals_portable_within_the_activation_bound(type_, shape, kernel_level, pools):
    packed, w_deq, x, n_out, n_in = _inputs(type_, shape, 100 + sum(shape))
    kernel_level("portable")
    reference = native.matmul(type_, packed, n_out, n_in, x, pool=pools[1])
    scale = np.abs(x).astype(np.float64) @ np.abs(w_deq).T.astype(np.float64)
    bound = activation_error_bound(w_deq, x, type_.block_elems) * 1.001 + 1e-5 * scale
    first = None
    for level in SIMD_LEVELS:
        kernel_level(level)
        results = [native.matmul(type_, packed, n_out, n_in, x, pool=pools[n]) for n in (1, 2, 3)]
        for other in results[1:]:
            np.testing.assert_array_equal(other, results[0])  # thread count changes nothing
        y = results[0]
        assert (np.abs(y - reference) <= bound).all(), level
        if first is None:
            first = y
        else:
            assert (np.abs(y - first) <= 1e-5 * scale).all(), level


@pytest.mark.parametrize("type_", QUANT_TYPES, ids=lambda t: t.name_in_pack)
def test_simd_matmul_reads_weights_at_any_alignment(type_, kernel_level):
    packed, _, x, n_out, n_in = _inputs(type_, (19, 3, 2), 7)
    shifted = bytearray(b"\0" + packed.tobytes())
    for level in native.supported_kernels():
        kernel_level(level)
        np.testing.assert_array_equal(native.matmul(type_, memoryview(shifted)[1:], n_out, n_in, x),
                                      native.matmul(type_, packed, n_out, n_in, x))


def test_kernel_levels_can_be_listed_and_forced(kernel_level):
    assert native.supported_kernels()[0] == "portable"
    assert native.kernels() in native.supported_kernels()
    kernel_level("portable")
    assert native.kernels() == "portable"
    with pytest.raises(native.InvalidArgumentError):
        native.set_kernels("sse9")
    for level in set(native.KERNEL_LEVELS) - set(native.supported_kernels()):
        with pytest.raises(native.NotSupportedError):
            native.set_kernels(level)


# ---------------------------------------------------------------------------------------
# Worker pool
# ---------------------------------------------------------------------------------------


def test_pool_survives_many_create_destroy_cycles():
    w = native.quantize(TensorType.Q8_0, gaussian((45, 64), 3))
    x = gaussian((2, 64), 4)
    want = native.matmul(TensorType.Q8_0, w, 45, 64, x, pool=native.ThreadPool(1))
    for cycle in range(200):
        with native.ThreadPool(1 + cycle % 4, spin_us=cycle % 3 * 50) as pool:
            if cycle % 2:  # half the pools are destroyed without ever running a job
                np.testing.assert_array_equal(native.matmul(TensorType.Q8_0, w, 45, 64, x, pool=pool), want)


def test_pool_pins_workers_to_the_cpus_it_is_given():
    import os

    allowed = sorted(os.sched_getaffinity(0))
    with native.ThreadPool() as pool:  # default: one thread per allowed CPU
        assert pool.n_threads == len(allowed)
        assert pool.worker_cpus == allowed[1:]
    with native.ThreadPool(3, cpus=[allowed[0]]) as pool:
        assert pool.n_threads == 3 and pool.worker_cpus == [allowed[0], allowed[0]]
    with pytest.raises(native.InvalidArgumentError):
        native.ThreadPool(cpus=[max(allowed) + 4096])
    with pytest.raises(native.InvalidArgumentError):
        native.ThreadPool(cpus=[-1])
    pool = native.ThreadPool(2)
    pool.close()
    pool.close()  # idempotent
    with pytest.raises(native.InvalidArgumentError):
        native.matmul(TensorType.F32, np.zeros((1, 32), np.float32), 1, 32, np.zeros((1, 32), np.float32), pool=pool)


def test_pool_struct_matches_c():
    assert native._lib().col_pool_params_size() == native.ctypes.sizeof(native._PoolParams)


# ---------------------------------------------------------------------------------------
# Fused experts
# ---------------------------------------------------------------------------------------


def _silu(v):
    return v / (1.0 + np.exp(-v))


def _experts(type_, n_experts, dim, ffn, seed):
    packed = []
    for e in range(n_experts):
        g, u, d = gaussian((ffn, dim), seed + 3 * e, 0.1), gaussian((ffn, dim), seed + 3 * e + 1, 0.1), gaussian((dim, ffn), seed + 3 * e + 2, 0.1)
        packed.append(tuple(native.quantize(type_, m) for m in (g, u, d)))
    return packed


def _moe_reference(type_, experts, dim, ffn, x, expert_of, weight):
    out = np.zeros(x.shape, np.float64)
    for e, (g, u, d) in enumerate(experts):
        gd, ud, dd = (native.dequantize(type_, m, *s).astype(np.float64) for m, s in ((g, (ffn, dim)), (u, (ffn, dim)), (d, (dim, ffn))))
        for t, a in zip(*np.nonzero(expert_of == e)):
            h = _silu(x[t] @ gd.T) * (x[t] @ ud.T)
            out[t] += weight[t, a] * (h @ dd.T)
    return out


@pytest.mark.parametrize("type_", [TensorType.F32, TensorType.BF16, TensorType.Q8_0, TensorType.Q4_G64], ids=lambda t: t.name_in_pack)
@pytest.mark.parametrize("n_tok", [1, 5])
def test_fused_experts_match_the_per_expert_reference(type_, n_tok, kernel_level, pools):
    n_experts, dim, ffn, top_k = 5, 192, 128, 3
    experts = _experts(type_, n_experts, dim, ffn, 50)
    rng = np.random.default_rng(n_tok)
    x = gaussian((n_tok, dim), 60)
    expert_of = np.stack([rng.permutation(n_experts)[:top_k] for _ in range(n_tok)]).astype(np.int32)
    expert_of[0, -1] = -1  # a slot without an expert is skipped
    weight = rng.random((n_tok, top_k)).astype(np.float32)
    want = _moe_reference(type_, experts, dim, ffn, x, expert_of, weight)
    tolerance = {"portable": 1e-4}  # relative to max |want|; SIMD: int8 activations twice, 4e-2
    for level in native.supported_kernels():
        kernel_level(level)
        results = []
        for n in (1, 2, 3):
            out = np.full((n_tok, dim), 0.5, np.float32)  # accumulates into out
            native.moe_experts(type_, *zip(*experts), dim, ffn, x, expert_of, weight, out, pool=pools[n])
            results.append(out - np.float32(0.5))
        for other in results[1:]:
            np.testing.assert_array_equal(other, results[0])
        quantized_activations = level != "portable" and type_ in QUANT_TYPES
        limit = 4e-2 if quantized_activations else tolerance["portable"]
        assert np.abs(results[0] - want).max() <= limit * np.abs(want).max() + 1e-6, level


def test_fused_experts_reject_bad_arguments():
    experts = _experts(TensorType.Q8_0, 2, 64, 32, 1)
    x, out = gaussian((1, 64), 2), np.zeros((1, 64), np.float32)
    gates, ups, downs = zip(*experts)
    with pytest.raises(native.InvalidArgumentError):
        native.moe_experts(TensorType.Q8_0, gates, ups, downs, 64, 32, x, np.array([[2]]), np.ones((1, 1), np.float32), out)
    with pytest.raises(native.InvalidArgumentError):
        native.moe_experts(TensorType.Q8_0, gates, ups[:1], downs, 64, 32, x, np.array([[0]]), np.ones((1, 1), np.float32), out)
    with pytest.raises(native.InvalidArgumentError):  # weights of the wrong size
        native.moe_experts(TensorType.Q8_0, gates, ups, downs, 64, 64, x, np.array([[0]]), np.ones((1, 1), np.float32), out)
    lib = native._lib()
    assert lib.col_moe_experts(None, int(TensorType.Q8_0), 1, None, None, None, 64, 32, x.ctypes.data, 1,
                               np.zeros(1, np.int32).ctypes.data, np.ones(1, np.float32).ctypes.data, 1, out.ctypes.data) == 1
    assert not out.any()


# ---------------------------------------------------------------------------------------
# RMSNorm, RoPE, attention
# ---------------------------------------------------------------------------------------


def test_rms_norm_matches_numpy():
    x, w = gaussian((3, 4, 96), 8), gaussian((96,), 9)
    want = w * (x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-5))
    np.testing.assert_allclose(native.rms_norm(x, w, 1e-5), want, rtol=2e-6, atol=1e-6)


def test_rope_matches_rotate_half():
    from colibrid.engine.rope import Rotary

    x = gaussian((5, 3, 16), 10)
    angles = gaussian((5, 16), 11)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    np.testing.assert_allclose(native.rope(x, cos, sin), Rotary.apply(x, cos, sin), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("n_q", [1, 4])
def test_attention_matches_masked_softmax(window, n_q, kernel_level, pools):
    S, H, K, Hd = 9, 6, 2, 32
    keys, values = gaussian((S, K, Hd), 12), gaussian((S, K, Hd), 13)
    q = gaussian((n_q, H, Hd), 14)
    positions = np.arange(S - n_q, S)
    scale = Hd ** -0.5
    qg = q.reshape(n_q, K, H // K, Hd).astype(np.float64)
    keys_j = np.arange(S)[None, :]
    visible = (keys_j <= positions[:, None]) & ((keys_j > positions[:, None] - window) if window else True)
    scores = np.einsum("tkgd,skd->kgts", qg, keys) * scale + np.where(visible, 0.0, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = np.einsum("kgts,skd->tkgd", probs, values).reshape(n_q, H * Hd)
    for level in native.supported_kernels():
        kernel_level(level)
        for n in (1, 2, 3):
            got = native.attention(q, keys, values, positions, window, scale, pool=pools[n])
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
