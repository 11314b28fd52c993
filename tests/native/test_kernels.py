"""libcolibri's fast paths against its reference: SIMD kernel levels, the worker pool, the
fused expert call, RMSNorm, RoPE and attention.

Tolerances, stated once:
  - portable level: float32 activations, error <= 1e-5 x (|x| @ |w|^T) (as in test_native);
  - SIMD levels with q8_0 / q4_g64 / mxfp4 weights quantize each block of activations to int8
    (blocks of 32 for q8_0 and mxfp4, 64 for q4_g64: the weight's block), so each activation is off by
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
QUANT_TYPES = [TensorType.Q8_0, TensorType.Q4_G64, TensorType.MXFP4]

# (n_out, n_in in blocks of 64, n_tok): row counts not multiples of the 16-row tile nor of
# the thread split, odd numbers of 32-blocks (n_in = 64k is 2k blocks of 32; 32*odd below)
SHAPES = [(1, 1, 1), (7, 3, 1), (37, 5, 2), (100, 2, 3), (257, 7, 5), (33, 16, 1), (129, 32, 4)]


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
    n_in = 64 * n_in_64 if type_ is TensorType.Q4_G64 else 32 * (2 * n_in_64 + 1)  # q8_0, mxfp4: odd block count
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
@pytest.mark.parametrize("n_in_64", [1, 3, 4, 9, 32])  # whole steps of the 4-block loops and tails
def test_a_token_gets_the_same_bits_alone_or_in_a_batch(type_, n_in_64, kernel_level, pools):
    """The one-token kernels (decode) and the kernels that share a weight block among two to
    four tokens (a decode batch, a prompt) do the same arithmetic: a row of a 2-, 3-, 4-, 5-,
    6- or 7-token product (groups of 2, 3, 4, 4 + 1 ...; on AVX-512 VNNI also the sixteen-row
    tile, which one thread gets whole from 21 rows) equals that token's product alone."""
    packed, _, x, n_out, n_in = _inputs(type_, (21, n_in_64, 7), 300 + n_in_64)
    for level in native.supported_kernels():
        kernel_level(level)
        alone = [native.matmul(type_, packed, n_out, n_in, x[t:t + 1]) for t in range(x.shape[0])]
        for n_tok in (2, 3, 4, 5, 6, 7):
            batch = native.matmul(type_, packed, n_out, n_in, x[:n_tok], pool=pools[1])
            for t in range(n_tok):
                np.testing.assert_array_equal(alone[t], batch[t:t + 1], err_msg=f"{level} {n_tok} tokens")


@pytest.mark.parametrize("type_", QUANT_TYPES, ids=lambda t: t.name_in_pack)
def test_a_row_gets_the_same_bits_whatever_rows_share_its_call(type_, kernel_level):
    """Kernels that tile several weight rows (AVX2's panels of eight rows in eight lanes) give
    each row the same bits whichever panel, lane or tail it lands in: the product of rows
    k..O of w equals those columns of the product of all rows, for every start k."""
    packed, _, x, n_out, n_in = _inputs(type_, (21, 5, 9), 400)
    row_bytes = type_.row_bytes(n_in)
    rows = np.frombuffer(packed.tobytes(), np.uint8).reshape(n_out, row_bytes)
    for level in native.supported_kernels():
        kernel_level(level)
        full = native.matmul(type_, packed, n_out, n_in, x)
        for k in range(1, 9):
            part = native.matmul(type_, np.ascontiguousarray(rows[k:]), n_out - k, n_in, x)
            np.testing.assert_array_equal(part, full[:, k:], err_msg=f"{level} rows {k}..")
        single = native.matmul(type_, np.ascontiguousarray(rows[13:14]), 1, n_in, x[4:5])
        np.testing.assert_array_equal(single, full[4:5, 13:14], err_msg=level)


@pytest.mark.parametrize("type_", QUANT_TYPES, ids=lambda t: t.name_in_pack)
def test_a_long_prompt_gives_each_token_its_own_bits(type_, kernel_level):
    """At a prompt's size (many token groups, rows in several tiles and panels, full-width
    activation rows) every token's product equals its product alone."""
    packed, _, x, n_out, n_in = _inputs(type_, (40, 32, 67), 500)
    for level in native.supported_kernels():
        kernel_level(level)
        batch = native.matmul(type_, packed, n_out, n_in, x)
        for t in (0, 1, 3, 4, 31, 64, 66):
            np.testing.assert_array_equal(native.matmul(type_, packed, n_out, n_in, x[t:t + 1]), batch[t:t + 1],
                                          err_msg=f"{level} token {t}")


PANEL_LEVELS = [level for level in ("avx2", "avx512", "avx512_vnni") if level in native.supported_kernels()]


@pytest.mark.skipif(len(PANEL_LEVELS) < 2, reason="needs two of the avx2, avx512 and avx512_vnni levels")
@pytest.mark.parametrize("type_", [native.TensorType.Q8_0, native.TensorType.Q4_G64], ids=lambda t: t.name_in_pack)
def test_the_panel_levels_give_the_same_bits(type_, kernel_level, pools):
    """avx2, avx512 and avx512_vnni compute q8_0 and q4_g64 products with the same panels and
    float chain (only the exact integer step differs: VNNI's, in panels or 512-bit tiles), so
    these products do not depend on which of the three a machine has (norms and activations
    still have their own kernels per level)."""
    packed, _, x, n_out, n_in = _inputs(type_, (21, 32, 6), 600)  # one thread: a whole tile, chunks of blocks
    results = {}
    for level in PANEL_LEVELS:
        kernel_level(level)
        results[level] = native.matmul(type_, packed, n_out, n_in, x, pool=pools[1])
    for level in PANEL_LEVELS[1:]:
        np.testing.assert_array_equal(results[level], results[PANEL_LEVELS[0]], err_msg=level)


@pytest.mark.skipif(len(SIMD_LEVELS) < 2, reason="needs two SIMD levels to compare")
@pytest.mark.parametrize("type_", QUANT_TYPES, ids=lambda t: t.name_in_pack)
def test_every_level_quantizes_activations_the_same(type_, kernel_level):
    """An identity weight passes each int8 activation through: every level (AVX2 quantizes
    one value at a time, AVX-512 sixteen) must round the same, ties to even included."""
    n = 256
    x = np.tile(np.float32([127, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5]), (3, n // 8))
    x[1] = gaussian((n,), 160, 3.0)
    x[2, :64] = 0.0  # an all-zero block: scale 0
    x[2, 64:128] *= np.float32(1e-30)  # tiny values
    eye = native.quantize(type_, np.eye(n, dtype=np.float32))
    results = {}
    for level in SIMD_LEVELS:
        kernel_level(level)
        results[level] = native.matmul(type_, eye, n, n, x)
    # one quantization step of each value's block; a different rounding is a whole step off,
    # the levels' float sums (VNNI's offset lane cancels large terms) only a few percent
    block = type_.block_elems
    step = np.repeat(np.abs(x).reshape(3, n // block, block).max(axis=2) / 127, block, axis=1)
    first = results[SIMD_LEVELS[0]]
    for level, y in results.items():
        assert (np.abs(y - first) <= 0.25 * step).all(), level
    np.testing.assert_allclose(first[0, :8], [127, 2, -4, 0, 0, 2, 126, -126], rtol=2e-3, atol=1e-5)  # halves to even


@pytest.mark.skipif(len(SIMD_LEVELS) < 2, reason="needs two SIMD levels to compare")
@pytest.mark.parametrize("type_", [TensorType.Q8_0, TensorType.Q4_G64], ids=lambda t: t.name_in_pack)
def test_every_level_quantizes_a_nan_the_same(type_, kernel_level):
    """Through an identity weight: a NaN is left out of its block's scale and becomes -127 on
    every level (its output is -max|block|, the rest of the block keeps its own values)."""
    n, block = 128, type_.block_elems
    x = gaussian((2, n), 170)
    nan_at = [(0, 5), (0, block - 1), (1, n - 1)]  # inside a block and last (the running max meets it last)
    for t, j in nan_at:
        x[t, j] = np.nan
    eye = native.quantize(type_, np.eye(n, dtype=np.float32))
    step = np.repeat(np.nanmax(np.abs(x).reshape(2, n // block, block), axis=2) / 127, block, axis=1)
    for level in SIMD_LEVELS:
        kernel_level(level)
        y = native.matmul(type_, eye, n, n, x)
        np.testing.assert_allclose([y[t, j] for t, j in nan_at], [-127 * step[t, j] for t, j in nan_at], rtol=1e-3,
                                   err_msg=level)
        finite = ~np.isnan(x)
        assert (np.abs(y - np.nan_to_num(x))[finite] <= 0.51 * step[finite]).all(), level


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


def test_default_pool_as_the_first_call_of_a_process():
    """default_pool() loads the library under the same lock it then takes: no deadlock."""
    import subprocess
    import sys

    code = "from colibrid import native; print(native.default_pool().n_threads)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and int(done.stdout) >= 1, done.stderr


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


@pytest.mark.parametrize("type_", [TensorType.F32, TensorType.BF16, *QUANT_TYPES], ids=lambda t: t.name_in_pack)
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


@pytest.mark.parametrize("type_", [TensorType.F32, *QUANT_TYPES], ids=lambda t: t.name_in_pack)
@pytest.mark.parametrize("shape", [(3, 128, 192, 2, 11), (2, 64, 64, 2, 70)],
                         ids=["5-9 tokens an expert", "70 tokens an expert"])
def test_fused_experts_give_a_token_the_same_bits_alone_or_with_others(type_, shape, kernel_level):
    """The batching guarantee for the expert FFN: a token routed to experts that also serve
    other tokens (groups of four, tails, any place in an expert's list, more than the 64 a
    tile meets at once) gets exactly the bits it gets alone, on every level."""
    n_experts, dim, ffn, top_k, n_tok = shape
    experts = _experts(type_, n_experts, dim, ffn, 70)
    rng = np.random.default_rng(7)
    x = gaussian((n_tok, dim), 80)
    expert_of = np.stack([rng.permutation(n_experts)[:top_k] for _ in range(n_tok)]).astype(np.int32)
    weight = rng.random((n_tok, top_k)).astype(np.float32)
    for level in native.supported_kernels():
        kernel_level(level)
        together = np.zeros((n_tok, dim), np.float32)
        native.moe_experts(type_, *zip(*experts), dim, ffn, x, expert_of, weight, together)
        for t in range(n_tok):
            alone = np.zeros((1, dim), np.float32)
            native.moe_experts(type_, *zip(*experts), dim, ffn, x[t:t + 1], expert_of[t:t + 1], weight[t:t + 1], alone)
            np.testing.assert_array_equal(alone, together[t:t + 1], err_msg=f"{level} token {t}")


def test_silu_mul_matches_numpy_on_every_level(kernel_level):
    """SwiGLU's elementwise step, which AVX-512 computes with its own vectorized exp: within
    2 ulp of the float64 value over the whole range, the saturated ends exact (g of -100
    gives -0, of +100 gives g), non-finite g as the formula gives."""
    g = np.concatenate([np.linspace(-110, 110, 4001), gaussian((997,), 150, 3.0)]).astype(np.float32)  # odd length: a tail
    u = gaussian(g.shape, 151, 1.0) + np.float32(0.5)
    g64 = g.astype(np.float64)
    want = g64 / (1.0 + np.exp(-g64)) * u.astype(np.float64)
    for level in native.supported_kernels():
        kernel_level(level)
        got = native.silu_mul(g, u)
        np.testing.assert_allclose(got, want, rtol=2.5e-7, atol=1e-30, err_msg=level)
        edge = native.silu_mul(np.array([-100, 100, np.nan, np.inf, -np.inf], np.float32), np.ones(5, np.float32))
        assert edge[0] == 0 and np.signbit(edge[0]) and edge[1] == 100, (level, edge)
        np.testing.assert_array_equal(edge[2:], [np.nan, np.inf, np.nan])  # -inf / (1 + inf), as the formula


def test_gelu_tanh_mul_matches_the_formula_and_torch_on_every_level(kernel_level):
    """GeGLU's elementwise step (Gemma 4's gelu_pytorch_tanh), which libcolibri writes through
    the sigmoid: within a few ulp of the float64 value over the whole range on every level,
    within float32 rounding of torch's tanh form where that form does not cancel, and the
    ends as the formula gives them."""
    import torch

    g = np.concatenate([np.linspace(-30, 30, 4001), gaussian((997,), 152, 3.0)]).astype(np.float32)  # odd: a tail
    u = gaussian(g.shape, 153, 1.0) + np.float32(0.5)
    g64 = g.astype(np.float64)
    with np.errstate(over="ignore"):
        want = g64 / (1.0 + np.exp(-2.0 * np.sqrt(2.0 / np.pi) * (g64 + 0.044715 * g64 ** 3))) * u.astype(np.float64)
    torch_h = (torch.nn.functional.gelu(torch.from_numpy(g), approximate="tanh") * torch.from_numpy(u)).numpy()
    for level in native.supported_kernels():
        kernel_level(level)
        got = native.gelu_tanh_mul(g, u)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=level)
        np.testing.assert_allclose(got, torch_h, rtol=0, atol=2e-6 * np.abs(torch_h).max(), err_msg=level)
        edge = native.gelu_tanh_mul(np.array([-100, 100, np.nan, np.inf, -np.inf], np.float32), np.ones(5, np.float32))
        assert edge[0] == 0 and edge[1] == 100, (level, edge)
        assert np.isnan(edge[2]) and edge[3] == np.inf and np.isnan(edge[4]), (level, edge)  # -inf * 0, as torch


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


@pytest.mark.parametrize("n", [96, 2048, 2083])  # 2083: past the 32- and 16-wide loops
def test_rms_norm_matches_numpy_on_every_level(n, kernel_level):
    x, w = gaussian((3, 4, n), 8), gaussian((n,), 9)
    want = w * (x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-5))
    for level in native.supported_kernels():
        kernel_level(level)
        np.testing.assert_allclose(native.rms_norm(x, w, 1e-5), want, rtol=2e-6, atol=1e-6, err_msg=level)


def test_rope_matches_rotate_half():
    from colibrid.engine.forward.rope import Rotary

    x = gaussian((5, 3, 16), 10)
    angles = gaussian((5, 16), 11)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    np.testing.assert_allclose(native.rope(x, cos, sin), Rotary.apply(x, cos, sin), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rotary_dim", [0, 2, 8, 16])
def test_partial_rope_rotates_the_leading_dims_only(rotary_dim):
    """transformers' apply_rotary_pos_emb with cos/sin narrower than the head (GLM-4.5):
    rotate-half within the first rotary_dim dims, the rest passed through."""
    x = gaussian((5, 3, 16), 15)
    angles = gaussian((5, rotary_dim), 16)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    rotated = x[..., :rotary_dim]
    half = rotary_dim // 2
    turned = np.concatenate([-rotated[..., half:], rotated[..., :half]], axis=-1)
    want = np.concatenate([rotated * cos[:, None] + turned * sin[:, None], x[..., rotary_dim:]], axis=-1)
    np.testing.assert_allclose(native.rope(x, cos, sin), want, rtol=1e-6, atol=1e-6)
    with pytest.raises(native.InvalidArgumentError):
        native.rope(x, np.ones((5, 18), np.float32), np.ones((5, 18), np.float32))  # wider than the head


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("n_q", [1, 4])
# 150 keys: the values in several tiles of 64 keys; head dims of whole and partial chunks of four vectors
@pytest.mark.parametrize("S, Hd", [(9, 32), (150, 80), (70, 128)])
def test_attention_matches_masked_softmax(window, n_q, S, Hd, kernel_level, pools):
    H, K = 6, 2
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


# ---------------------------------------------------------------------------------------
# Fused attention step and router
# ---------------------------------------------------------------------------------------

D_ATTN, H_ATTN, K_ATTN, HD_ATTN = 128, 4, 2, 32  # Q = 128, KV = 64


def _attention_weights(qkv_type, o_type, qk_norm, biases, seed):
    Q, KV = H_ATTN * HD_ATTN, K_ATTN * HD_ATTN
    w = {name: native.quantize(t, gaussian(shape, seed + i, 0.2)) if t is not TensorType.F32 else gaussian(shape, seed + i, 0.2)
         for i, (name, t, shape) in enumerate((("wq", qkv_type, (Q, D_ATTN)), ("wk", qkv_type, (KV, D_ATTN)),
                                               ("wv", qkv_type, (KV, D_ATTN)), ("wo", o_type, (D_ATTN, Q))))}
    norm = 1.0 + gaussian((D_ATTN,), seed + 5, 0.1)
    extra = {}
    if biases:
        extra.update(bq=gaussian((Q,), seed + 6, 0.1), bk=gaussian((KV,), seed + 7, 0.1), bv=gaussian((KV,), seed + 8, 0.1),
                     bo=gaussian((D_ATTN,), seed + 9, 0.1))
    if qk_norm != "none":
        widths = (Q, KV) if qk_norm == "full" else (HD_ATTN, HD_ATTN)
        extra.update(q_norm=1.0 + gaussian((widths[0],), seed + 10, 0.1), k_norm=1.0 + gaussian((widths[1],), seed + 11, 0.1))
    return norm, w, extra


def _attention_steps(qkv_type, o_type, norm, w, extra, qk_norm, clip, window, x, cos, sin, keys, values, n_past, pool):
    """The reference: the separate entry points and numpy, in the order of engine/attention.py."""
    Q, KV, T = H_ATTN * HD_ATTN, K_ATTN * HD_ATTN, x.shape[0]
    eps = 1e-5
    h = native.rms_norm(x, norm, eps)
    q, k, v = (native.matmul(qkv_type, w[name], rows, D_ATTN, h, pool=pool) for name, rows in (("wq", Q), ("wk", KV), ("wv", KV)))
    for name, bias in (("bq", 0), ("bk", 1), ("bv", 2)):
        if name in extra:
            (q, k, v)[bias][...] = (q, k, v)[bias] + extra[name]
    if qk_norm == "full":
        q, k = native.rms_norm(q, extra["q_norm"], eps), native.rms_norm(k, extra["k_norm"], eps)
    if clip is not None:
        q, k, v = (np.clip(t, -clip, clip) for t in (q, k, v))
    q, k, v = q.reshape(T, H_ATTN, HD_ATTN), k.reshape(T, K_ATTN, HD_ATTN), v.reshape(T, K_ATTN, HD_ATTN)
    if qk_norm == "head":
        q, k = native.rms_norm(q, extra["q_norm"], eps), native.rms_norm(k, extra["k_norm"], eps)
    q, k = native.rope(q, cos, sin), native.rope(k, cos, sin)
    keys[n_past:n_past + T], values[n_past:n_past + T] = k, v
    positions = np.arange(n_past, n_past + T)
    a = native.attention(q, keys[:n_past + T], values[:n_past + T], positions, window, HD_ATTN ** -0.5, pool=pool)
    o = native.matmul(o_type, w["wo"], D_ATTN, Q, a, pool=pool)
    if "bo" in extra:
        o = o + extra["bo"]
    return x + o


ATTENTION_CASES = [  # (qkv type, o type, qk_norm, biases, clip, window)
    (TensorType.F32, TensorType.F32, "none", True, None, None),
    (TensorType.BF16, TensorType.Q8_0, "head", False, None, 3),
    (TensorType.Q8_0, TensorType.Q8_0, "full", False, 0.6, None),
    (TensorType.Q4_G64, TensorType.Q4_G64, "none", True, None, 4),
    (TensorType.Q4_G64, TensorType.Q8_0, "head", True, 0.5, None),
]


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: f"{c[0].name_in_pack}-{c[1].name_in_pack}-{c[2]}-bias{int(c[3])}-clip{c[4]}-win{c[5]}")
@pytest.mark.parametrize("n_tok", [1, 3, 20])  # 20: the block's queries in several blocks of 8 tokens x 2 heads
def test_attention_block_equals_the_separate_steps_bit_for_bit(case, n_tok, kernel_level, pools):
    qkv_type, o_type, qk_norm, biases, clip, window = case
    norm, w, extra = _attention_weights(qkv_type, o_type, qk_norm, biases, 70)
    layer = native.attention_layer(D_ATTN, H_ATTN, K_ATTN, HD_ATTN, norm, qkv_type, w["wq"], w["wk"], w["wv"], o_type, w["wo"],
                                   eps=1e-5, scale=HD_ATTN ** -0.5, window=window, clip_qkv=clip, qk_norm=qk_norm, **extra)
    n_past, capacity = 5, 8 + n_tok
    x = gaussian((n_tok, D_ATTN), 80)
    angles = gaussian((n_tok, HD_ATTN), 81)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    past_keys, past_values = gaussian((capacity, K_ATTN, HD_ATTN), 82), gaussian((capacity, K_ATTN, HD_ATTN), 83)
    for level in native.supported_kernels():
        kernel_level(level)
        want_keys, want_values = past_keys.copy(), past_values.copy()
        want = _attention_steps(qkv_type, o_type, norm, w, extra, qk_norm, clip, window, x, cos, sin, want_keys, want_values,
                                n_past, pools[1])
        for n in (1, 2, 3):
            got, keys, values = x.copy(), past_keys.copy(), past_values.copy()
            native.attention_block(layer, got, cos, sin, keys, values, n_past, pool=pools[n])
            np.testing.assert_array_equal(got, want, err_msg=f"{level}, {n} threads")
            np.testing.assert_array_equal(keys, want_keys)  # rows n_past.. written, the others kept
            np.testing.assert_array_equal(values, want_values)


@pytest.mark.parametrize("rotary_dim", [8, 16])
def test_attention_block_with_partial_rotary_equals_the_separate_steps(rotary_dim, kernel_level, pools):
    norm, w, extra = _attention_weights(TensorType.Q8_0, TensorType.Q8_0, "head", True, 75)
    layer = native.attention_layer(D_ATTN, H_ATTN, K_ATTN, HD_ATTN, norm, TensorType.Q8_0, w["wq"], w["wk"], w["wv"],
                                   TensorType.Q8_0, w["wo"], eps=1e-5, scale=HD_ATTN ** -0.5, qk_norm="head",
                                   rotary_dim=rotary_dim, **extra)
    n_past, capacity, n_tok = 4, 9, 3
    x = gaussian((n_tok, D_ATTN), 85)
    angles = gaussian((n_tok, rotary_dim), 86)
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    past_keys, past_values = gaussian((capacity, K_ATTN, HD_ATTN), 87), gaussian((capacity, K_ATTN, HD_ATTN), 88)
    for level in native.supported_kernels():
        kernel_level(level)
        want_keys, want_values = past_keys.copy(), past_values.copy()
        want = _attention_steps(TensorType.Q8_0, TensorType.Q8_0, norm, w, extra, "head", None, None, x, cos, sin,
                                want_keys, want_values, n_past, pools[1])
        for n in (1, 2):
            got, keys, values = x.copy(), past_keys.copy(), past_values.copy()
            native.attention_block(layer, got, cos, sin, keys, values, n_past, pool=pools[n])
            np.testing.assert_array_equal(got, want, err_msg=f"{level}, {n} threads")
            np.testing.assert_array_equal(keys, want_keys)
    with pytest.raises(native.InvalidArgumentError):  # tables as wide as the whole head
        native.attention_block(layer, x.copy(), np.ones((n_tok, HD_ATTN), np.float32), np.ones((n_tok, HD_ATTN), np.float32),
                               past_keys.copy(), past_values.copy(), n_past)


def test_attention_block_rejects_bad_arguments():
    norm, w, extra = _attention_weights(TensorType.Q8_0, TensorType.Q8_0, "none", False, 90)
    args = (D_ATTN, H_ATTN, K_ATTN, HD_ATTN, norm, TensorType.Q8_0, w["wq"], w["wk"], w["wv"], TensorType.Q8_0)
    with pytest.raises(native.InvalidArgumentError):  # wo of the wrong size
        native.attention_layer(*args, w["wq"][:1], eps=1e-5, scale=1.0)
    with pytest.raises(native.InvalidArgumentError):  # head norm without its weights
        native.attention_layer(*args, w["wo"], eps=1e-5, scale=1.0, qk_norm="head")
    layer = native.attention_layer(*args, w["wo"], eps=1e-5, scale=1.0)
    x = gaussian((2, D_ATTN), 91)
    cos = sin = np.ones((2, HD_ATTN), np.float32)
    keys = values = np.zeros((4, K_ATTN, HD_ATTN), np.float32)
    with pytest.raises(native.InvalidArgumentError):  # the cache is too short for 3 + 2 tokens
        native.attention_block(layer, x, cos, sin, keys, values, 3)
    with pytest.raises(native.InvalidArgumentError):
        native.attention_block(layer, x, cos[:1], sin[:1], keys, values, 0)
    bad = native.AttentionLayer.from_buffer_copy(layer)
    bad.n_kv_heads = 3  # 4 heads are not a multiple of 3
    before = x.copy()
    assert native._lib().col_attention_block(None, native.ctypes.addressof(bad), x.ctypes.data, 2, cos.ctypes.data,
                                             sin.ctypes.data, keys.ctypes.data, values.ctypes.data, 0, 0) == 1
    np.testing.assert_array_equal(x, before)
    assert not keys.any()


@pytest.mark.parametrize("type_", [TensorType.F32, TensorType.Q8_0], ids=lambda t: t.name_in_pack)
@pytest.mark.parametrize("normalize", [False, True])
def test_moe_route_picks_the_top_k_of_the_softmax(type_, normalize, pools):
    n_experts, dim, top_k, n_tok = 12, 64, 3, 5
    router = gaussian((n_experts, dim), 100)
    data = router if type_ is TensorType.F32 else native.quantize(type_, router)
    x = gaussian((n_tok, dim), 101)
    logits = native.matmul(type_, data, n_experts, dim, x).astype(np.float64)
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    want_experts = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]
    want_weights = np.take_along_axis(probs, want_experts, axis=1)
    if normalize:
        want_weights /= want_weights.sum(axis=1, keepdims=True)
    for n in (1, 2):
        experts, weights = native.moe_route(type_, data, n_experts, dim, x, top_k, normalize, pool=pools[n])
        np.testing.assert_array_equal(experts, want_experts)
        np.testing.assert_allclose(weights, want_weights, rtol=1e-5, atol=1e-7)


def test_moe_route_breaks_ties_toward_the_lower_index():
    router = np.zeros((6, 32), np.float32)  # every logit 0: six equal probabilities
    experts, weights = native.moe_route(TensorType.F32, router, 6, 32, gaussian((2, 32), 102), 4, True)
    np.testing.assert_array_equal(experts, [[0, 1, 2, 3]] * 2)
    np.testing.assert_allclose(weights, 0.25)
    with pytest.raises(native.InvalidArgumentError):
        native.moe_route(TensorType.F32, router, 6, 32, gaussian((2, 32), 102), 7, True)


# (type, values per row): odd block counts and, for bf16, tails past the 8- and 16-wide loops
DEQUANT_CASES = [(TensorType.Q8_0, 32 * 7), (TensorType.Q4_G64, 64 * 9), (TensorType.MXFP4, 32 * 5),
                 (TensorType.BF16, 37), (TensorType.BF16, 512)]


def _rows_to_dequantize(type_, cols, seed):
    """(bytes, rows): quantized gaussian rows with edge values (zeros, a huge and a tiny row,
    an all-equal row) and rows of random bytes, which give every code and every scale bit
    pattern: f16 subnormals, infinities, NaNs, e8m0 255."""
    rng = np.random.default_rng(seed)
    values = gaussian((6, cols), seed)
    values[1] = 0.0
    values[2] *= 6e4 / np.abs(values[2]).max()
    values[3] *= 1e-6
    values[4] = 0.75
    packed = np.frombuffer(native.quantize(type_, values), dtype=np.uint8)
    noise = rng.integers(0, 256, size=16 * type_.row_bytes(cols), dtype=np.uint8)
    return np.concatenate([packed, noise]), 6 + 16


@pytest.mark.parametrize("case", DEQUANT_CASES, ids=lambda c: f"{c[0].name_in_pack}-{c[1]}")
def test_every_level_dequantizes_rows_to_the_reference_bits(case, kernel_level):
    """The SIMD row dequantizers (col_dequantize, col_get_rows, MLA's kv_b rows) give the
    portable dequantizer's float32 bits, NaN payloads and -0.0 included."""
    type_, cols = case
    data, rows = _rows_to_dequantize(type_, cols, 7 + cols)
    ids = np.array([rows - 1, 0, 3, 3, 9], dtype=np.int32)
    kernel_level("portable")
    want = native.dequantize(type_, data, rows, cols).view(np.uint32)
    want_rows = native.get_rows(type_, data, cols, ids).view(np.uint32)
    assert np.isnan(want.view(np.float32)).any() or type_ is TensorType.MXFP4  # the random bytes reach NaN scales
    for level in SIMD_LEVELS:
        kernel_level(level)
        np.testing.assert_array_equal(native.dequantize(type_, data, rows, cols).view(np.uint32), want, err_msg=level)
        np.testing.assert_array_equal(native.get_rows(type_, data, cols, ids).view(np.uint32), want_rows, err_msg=level)
