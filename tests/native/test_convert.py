"""col_convert (colibri-convert's quantizer on the pool) against the one-thread col_quantize.

The contract: for every element type, every source dtype (f32, f16, bf16, FP8 e4m3 with block
scales), every thread count and every kernel level, the bytes equal col_quantize's on the
source decoded to float32 exactly. The row quantizers themselves are pinned to the bytes the
converter wrote before it ran on the pool (the digests below, computed with that code on
``awkward_rows``): a faster quantizer must not change a single pack.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from colibrid import native
from colibrid.tools.convert import fp8
from colibrid.native import TensorType

ALL_TYPES = list(TensorType)
LEVELS = native.supported_kernels()

# sha256 of quantize(type, awkward_rows(14, 96, 512)) by the one-thread quantizers of main
# before col_convert (commit 7518543): the pack bytes of today.
TODAY_DIGESTS = {
    "f32": "5ba68073731d15d52b89380391a1e8dee9a2733609ea6677e166a1683651d87e",
    "f16": "0defde5e43daab8a3faa0245a7f00738fbdc9e6df48ca34371606db2511bba47",
    "bf16": "ade9aa8c4e346d6a0f5d17b035c46a345f4fec8cb5a11dbfe55aa2c5c680f842",
    "q8_0": "469f2d32877b52739b585ac24b461c54eec5b376382b742cfcce210b04cbe1f0",
    "q4_g64": "fc4df56746556521e03aa156f26bfa9cf6aff3a718e55a98599ae8554b64fa73",
    "mxfp4": "e19ad8bbf50cf71f23d1094144ce1afb979b0c79cc8891cb8ad5787b4c06b8de",
}


def awkward_rows(seed: int, rows: int, cols: int) -> np.ndarray:
    """(rows, cols) float32 that walks the quantizers' branches: gaussian weights, outlier
    rows, spikes, a constant row, half-zero rows, tiny values (f16 subnormal scales),
    integers (exact levels), and a narrow spread around 1 (the q4_g64 offset search)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32) * np.float32(0.05)
    x[1::7] *= np.float32(30.0)
    x[2::5, ::13] = np.float32(4.0)
    x[3, :] = np.float32(0.25)
    x[4, : cols // 2] = 0.0
    x[5] *= np.float32(1e-6)
    x[6] = rng.integers(-8, 8, cols).astype(np.float32)
    x[7] = np.float32(1.0) + rng.standard_normal(cols).astype(np.float32) * np.float32(1e-4)
    return x


@pytest.fixture
def kernel_level():
    before = native.kernels()
    yield native.set_kernels
    native.set_kernels(before)


def as_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits by truncation (any bf16 pattern is a valid source value)."""
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("type_", ALL_TYPES, ids=lambda t: t.name_in_pack)
def test_row_quantizers_write_todays_bytes(type_, kernel_level):
    x = awkward_rows(14, 96, 512)
    for level in LEVELS:
        kernel_level(level)
        assert hashlib.sha256(native.quantize(type_, x).tobytes()).hexdigest() == TODAY_DIGESTS[type_.name_in_pack], level


@pytest.mark.parametrize("type_", ALL_TYPES, ids=lambda t: t.name_in_pack)
@pytest.mark.parametrize("dtype", ["F32", "F16", "BF16"])
def test_convert_equals_quantize_of_the_widened_source_for_every_thread_count(type_, dtype, pools, kernel_level):
    x = awkward_rows(3, 45, 384)  # 45 rows: not a multiple of the chunk nor of 2 or 3 threads
    if dtype == "F32":
        source, values = x, x
    elif dtype == "F16":
        source = x.astype(np.float16)
        values = source.astype(np.float32)
    else:
        source = as_bf16_bits(x)
        values = bf16_values(source)
    want = native.quantize(type_, values)
    for level in LEVELS:
        kernel_level(level)
        for n, pool in pools.items():
            got = native.convert(type_, source, dtype, pool=pool)
            assert got.tobytes() == want.tobytes(), (level, n)


@pytest.mark.parametrize("type_", [TensorType.Q8_0, TensorType.Q4_G64, TensorType.BF16], ids=lambda t: t.name_in_pack)
def test_convert_takes_every_other_row_of_an_interleaved_tensor(type_, pools):
    bits = as_bf16_bits(awkward_rows(5, 30, 128))
    values = bf16_values(bits)
    for rows in (slice(0, None, 2), slice(1, None, 2), slice(7, 20)):
        want = native.quantize(type_, np.ascontiguousarray(values[rows]))
        for pool in pools.values():
            assert native.convert(type_, bits, "BF16", rows=rows, pool=pool).tobytes() == want.tobytes()


def fp8_checkpoint_tensor(seed: int, rows: int, cols: int, block: tuple[int, int]):
    """Random e4m3 codes (NaN codes avoided) and block scales, as DeepSeek-V3 publishes."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # 0x7f / 0xff are NaN
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scale_inv = np.exp2(rng.uniform(-12, -4, grid)).astype(np.float32) * np.float32(1.37)
    return codes, scale_inv


@pytest.mark.parametrize("type_", ALL_TYPES, ids=lambda t: t.name_in_pack)
def test_fp8_block_scaled_source_equals_the_numpy_dequantization(type_, pools, kernel_level):
    block = (16, 64)  # partial last blocks: 40 rows, 320 columns
    codes, scale_inv = fp8_checkpoint_tensor(8, 40, 320, block)
    values = fp8.apply_block_scales(fp8.decode_e4m3(codes), scale_inv, block)
    want = native.quantize(type_, values)
    for level in LEVELS:
        kernel_level(level)
        for pool in pools.values():
            got = native.convert(type_, codes, "F8_E4M3", scale_inv=scale_inv, block=block, pool=pool)
            assert got.tobytes() == want.tobytes(), level
    odd_rows = native.convert(type_, codes, "F8_E4M3", rows=slice(1, None, 2), scale_inv=scale_inv, block=block)
    assert odd_rows.tobytes() == native.quantize(type_, np.ascontiguousarray(values[1::2])).tobytes()


def test_fp8_without_scales_decodes_every_code_exactly():
    codes = np.arange(256, dtype=np.uint8).reshape(8, 32)
    got = native.dequantize(TensorType.F32, native.convert(TensorType.F32, codes, "F8_E4M3"), 8, 32)
    want = fp8.decode_e4m3(codes)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got[~np.isnan(got)].view(np.uint32), want[~np.isnan(want)].view(np.uint32))  # -0.0 too


def test_an_fp8_nan_is_a_range_error_for_quantized_types():
    codes = np.zeros((4, 64), dtype=np.uint8)
    codes[2, 5] = 0x7F
    with pytest.raises(native.ValueRangeError):
        native.convert(TensorType.Q4_G64, codes, "F8_E4M3")


def test_convert_refuses_bad_sources_before_writing():
    bits = np.zeros((4, 64), dtype=np.uint16)
    with pytest.raises(native.InvalidArgumentError):
        native.convert(TensorType.Q8_0, bits, "F16")  # uint16 bits are BF16, not F16
    with pytest.raises(native.InvalidArgumentError):
        native.convert(TensorType.Q8_0, bits, "I32")
    with pytest.raises(native.InvalidArgumentError):
        native.convert(TensorType.Q4_G64, bits[:, :32], "BF16")  # not a whole q4_g64 block
    with pytest.raises(native.InvalidArgumentError):
        native.convert(TensorType.Q8_0, bits, "BF16", scale_inv=np.ones((1, 1), np.float32), block=(128, 128))
    with pytest.raises(native.InvalidArgumentError):
        native.convert(TensorType.Q8_0, np.zeros((4, 64), np.uint8), "F8_E4M3", scale_inv=np.ones((2, 1), np.float32),
                       block=(128, 128))
    assert native.convert(TensorType.Q8_0, bits, "BF16", rows=slice(4, None)).shape == (0, 68)


def q4_search_blocks(seed: int, n_blocks: int) -> np.ndarray:
    """(n_blocks / 32, 2048) float32, nine kinds of 64-value blocks in turn: gaussian, tiny,
    one spike, integer multiples of 1/8 (exact ties between candidates: the in-order float
    sums decide), a few values 1e7 smaller than the rest (sum q x not exact in double: summed
    in order), a narrow spread around 1, bf16-rounded, 1e-30 (f16-subnormal scales), and
    one third zeros among large values."""
    rng = np.random.default_rng(seed)
    n = n_blocks * 64
    kind = (np.arange(n) // 64) % 9
    x = (rng.standard_normal(n) * 0.05).astype(np.float32)
    x[kind == 1] *= np.float32(1e-4)
    x[(kind == 2) & (np.arange(n) % 64 == 5)] = 3.0
    x[kind == 3] = (rng.integers(0, 16, n) * 0.125).astype(np.float32)[kind == 3]
    x[(kind == 4) & (rng.integers(0, 8, n) == 0)] *= np.float32(1e-7)
    x[kind == 5] = (1 + 1e-4 * rng.standard_normal(n)).astype(np.float32)[kind == 5]
    x[kind == 6] = (x.view(np.uint32) & 0xFFFF0000).view(np.float32)[kind == 6]
    x[kind == 7] *= np.float32(1e-30)
    zeros = (kind == 8) & (rng.integers(0, 3, n) == 0)
    x[zeros] = 0.0
    x[(kind == 8) & ~zeros] *= np.float32(1000.0)
    return x.reshape(-1, 2048)


@pytest.mark.skipif(len(LEVELS) < 2, reason="no SIMD kernel level on this CPU")
def test_q4_g64_search_on_simd_levels_writes_the_reference_bytes(kernel_level):
    """The SIMD levels' q4_g64 quantizer (sums in any order where that is exact, in-order
    float sums only on near-ties) against the portable reference, block by block."""
    x = q4_search_blocks(21, 9 * 32 * 40)
    kernel_level("portable")
    want = native.quantize(TensorType.Q4_G64, x).reshape(-1, 36)
    for level in LEVELS[1:]:
        kernel_level(level)
        got = native.quantize(TensorType.Q4_G64, x).reshape(-1, 36)
        mismatched = np.flatnonzero((got != want).any(axis=1))
        assert mismatched.size == 0, f"{level}: blocks {mismatched[:10].tolist()} differ"


@pytest.mark.skipif(len(LEVELS) < 2, reason="no SIMD kernel level on this CPU")
def test_q4_g64_signed_zeros_keep_the_reference_offset(kernel_level):
    """Blocks whose minimum or maximum is a zero of either sign: the reference keeps the first
    of equal values, so the stored offset's sign bit follows the block's order."""
    rng = np.random.default_rng(4)
    rows = []
    for first, other in ((0.0, -0.0), (-0.0, 0.0)):
        constant = np.full(64, other, np.float32)
        constant[0] = first
        positive = np.abs(rng.standard_normal(64)).astype(np.float32)
        positive[:2] = (first, other)
        negative = -np.abs(rng.standard_normal(64)).astype(np.float32)
        negative[:2] = (first, other)
        rows += [constant, positive, negative]
    x = np.stack(rows).reshape(-1, 64)
    kernel_level("portable")
    want = native.quantize(TensorType.Q4_G64, x)
    for level in LEVELS[1:]:
        kernel_level(level)
        assert native.quantize(TensorType.Q4_G64, x).tobytes() == want.tobytes(), level


def q4_edge_blocks(seed: int, n_blocks: int) -> np.ndarray:
    """(n_blocks, 64) float32, each block one of thirteen kinds drawn at random (so neighbouring
    SIMD lanes walk candidate chains of different lengths): gaussian; all zeros; constant;
    zeros of both signs; +-65504 (the f16 limit); values up to 65504 with a few tiny ones; f16
    subnormal scales (1e-6); float subnormals (1e-40); random float bit patterns within f16
    range (exponent spans up to 2^-149 .. 2^15); values halfway between f16 neighbours; two
    values only; one spike on zeros; and constant blocks on the f16 rounding's edges (a
    constant block stores its value rounded to f16 as the offset): ties and near-ties
    between f16 subnormals and normals."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n_blocks, 64)) * 0.05).astype(np.float32)
    for b, kind in enumerate(rng.integers(0, 13, n_blocks)):
        row = x[b]
        if kind == 1:
            row[:] = 0.0
        elif kind == 2:
            row[:] = np.float32(rng.standard_normal())
        elif kind == 3:
            row[:] = np.where(rng.integers(0, 2, 64) == 1, np.float32(-0.0), np.float32(0.0))
        elif kind == 4:
            row[:] = np.where(rng.integers(0, 2, 64) == 1, np.float32(65504.0), np.float32(-65504.0))
        elif kind == 5:
            row[:] = rng.uniform(-65504, 65504, 64).astype(np.float32)
            row[rng.integers(0, 64, 3)] = np.float32(1e-7)
        elif kind == 6:
            row *= np.float32(2e-5)
        elif kind == 7:
            row[:] = (rng.integers(-(1 << 20), 1 << 20, 64) * 1e-45).astype(np.float32)
        elif kind == 8:
            bits = rng.integers(0, 1 << 31, 64, dtype=np.uint32) | (rng.integers(0, 2, 64, dtype=np.uint32) << 31)
            row[:] = bits.view(np.float32)
            row[~(np.abs(row) <= 65504)] = np.float32(1.0)
        elif kind == 9:  # f16 value + half an f16 step: ties for the f16 rounding of d and m
            h = rng.integers(0x3C00, 0x4C00, 64).astype(np.uint16).view(np.float16).astype(np.float32)
            row[:] = h * np.float32(1 + 2.0 ** -11)
        elif kind == 10:
            row[:] = np.where(rng.integers(0, 2, 64) == 1, np.float32(0.75), np.float32(-1.25))
        elif kind == 11:
            row[:] = 0.0
            row[rng.integers(0, 64)] = np.float32(rng.uniform(-100, 100))
        elif kind == 12:  # (k + 1/2 + tiny) f16 steps, k both even and odd, subnormal or normal
            step = np.float32(2.0 ** -24) * np.float32(2.0 ** rng.choice([0, 0, 0, 5, 10, 12]))
            nudge = np.float32(rng.choice([0.0, 0.0, 2.0 ** -10, -(2.0 ** -10)]))
            sign = np.float32(rng.choice([1.0, -1.0]))
            row[:] = sign * (np.float32(rng.integers(0, 1100)) + np.float32(0.5) + nudge) * step
    return x


@pytest.mark.skipif(len(LEVELS) < 2, reason="no SIMD kernel level on this CPU")
@pytest.mark.parametrize("blocks_per_row", [1, 5, 8, 16, 23, 32])
def test_q4_g64_search_in_simd_lanes_writes_the_reference_bytes_on_edge_cases(blocks_per_row, kernel_level):
    """The SIMD levels search 8 or 16 blocks at once, one per lane (a row's last group is
    partial); every block's bytes must be the portable reference's, whatever its neighbours."""
    x = q4_edge_blocks(blocks_per_row, blocks_per_row * 400).reshape(-1, blocks_per_row * 64)
    kernel_level("portable")
    want = native.quantize(TensorType.Q4_G64, x).reshape(-1, 36)
    for level in LEVELS[1:]:
        kernel_level(level)
        got = native.quantize(TensorType.Q4_G64, x).reshape(-1, 36)
        mismatched = np.flatnonzero((got != want).any(axis=1))
        assert mismatched.size == 0, f"{level}: blocks {mismatched[:10].tolist()} differ"


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 65505.0, -1e30])
@pytest.mark.parametrize("block", [0, 7, 15, 18])
def test_q4_g64_value_out_of_range_is_an_error_on_every_level(bad, block, kernel_level):
    x = q4_edge_blocks(3, 20).reshape(1, -1)
    x[0, block * 64 + 37] = bad
    for level in LEVELS:
        kernel_level(level)
        with pytest.raises(native.ValueRangeError):
            native.quantize(TensorType.Q4_G64, x)
