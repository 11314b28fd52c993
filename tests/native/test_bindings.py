"""libcolibri kernels against plain numpy references.

Each test states one property of colibri.h: conversions are bit-exact where the format is
defined bit by bit (f16, bf16, q8_0, mxfp4 decoding), bounded where the encoder has freedom (q4_g64), matmul
equals x @ dequantize(w).T, and bad arguments raise typed errors instead of crashing.
"""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from colibrid import native
from colibrid.native import TensorType

ALL_TYPES = list(TensorType)
RNG_SEED = 1234


def rng(salt: int = 0) -> np.random.Generator:
    return np.random.default_rng(RNG_SEED + salt)


def gaussian(rows: int, cols: int, salt: int = 0, scale: float = 1.0) -> np.ndarray:
    return (rng(salt).standard_normal((rows, cols)) * scale).astype(np.float32)


def f16_value(bits: np.ndarray) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint16).view(np.float16).astype(np.float32)


# ---------------------------------------------------------------------------------------
# Reference encoders
# ---------------------------------------------------------------------------------------


def round_half_away(v: np.ndarray) -> np.ndarray:
    """C roundf, exactly: v - trunc(v) is exact in float32, so the tie test is exact."""
    t = np.trunc(v)
    return np.where(np.abs(v - t) >= 0.5, t + np.sign(v), t).astype(np.float32)


def q8_0_reference(x: np.ndarray) -> np.ndarray:
    """ggml's Q8_0 in numpy: (R, C) float32 -> (R, C/32*34) uint8."""
    rows, cols = x.shape
    blocks = x.reshape(rows, cols // 32, 32)
    amax = np.abs(blocks).max(axis=2)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv_d = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = round_half_away(blocks * inv_d[..., None]).astype(np.int8)
    out = np.empty((rows, cols // 32, 34), dtype=np.uint8)
    out[..., :2] = d.astype(np.float16).view(np.uint8).reshape(rows, cols // 32, 2)
    out[..., 2:] = q.view(np.uint8)
    return out.reshape(rows, -1)


def bf16_reference_bits(x: np.ndarray) -> np.ndarray:
    """Round to nearest even on the upper 16 bits (torch's scalar rule)."""
    u = x.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def q4_blocks(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Splits q4_g64 rows (R, C/64*36) into d (R, B), m (R, B) as float32 and q (R, B, 64)."""
    rows = packed.shape[0]
    blk = packed.reshape(rows, -1, 36)
    d = f16_value(blk[..., 0:2].copy().view(np.uint16)[..., 0])
    m = f16_value(blk[..., 2:4].copy().view(np.uint16)[..., 0])
    qs = blk[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2)
    return d, m, q


def q4_minmax_dequant(x: np.ndarray) -> np.ndarray:
    """Plain min/max 4-bit quantization with f16 d and m: the baseline q4_g64 must beat."""
    rows, cols = x.shape
    b = x.reshape(rows, cols // 64, 64)
    lo, hi = b.min(axis=2), b.max(axis=2)
    d = ((hi - lo) / 15).astype(np.float16).astype(np.float32)
    m = lo.astype(np.float16).astype(np.float32)
    safe_d = np.where(d > 0, d, 1)
    q = np.clip(np.round((b - m[..., None]) / safe_d[..., None]), 0, 15)
    return (d[..., None] * q + m[..., None]).reshape(rows, cols)


def rel_rms(err: np.ndarray, x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(err.astype(np.float64) ** 2)) / np.sqrt(np.mean(x.astype(np.float64) ** 2)))


# ---------------------------------------------------------------------------------------
# Types and sizes
# ---------------------------------------------------------------------------------------


def test_type_table():
    expected = {"f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_g64": (64, 36), "mxfp4": (32, 17)}
    for t in ALL_TYPES:
        block, block_bytes = expected[t.name_in_pack]
        assert TensorType.from_name(t.name_in_pack) is t
        assert t.block_elems == block
        assert t.row_bytes(128) == 128 // block * block_bytes
        assert t.row_bytes(0) == 0
    assert TensorType.Q4_G64.row_bytes(64) * 8 / 64 == 4.5  # bits per weight
    assert TensorType.MXFP4.row_bytes(64) * 8 / 64 == 4.25
    assert native.version() == "0.1.0"


# ---------------------------------------------------------------------------------------
# Float types: bit-exact
# ---------------------------------------------------------------------------------------

F16_EDGES = np.array(
    [0.0, -0.0, 1.0, -1.0, 65504.0, -65504.0, 65519.99, 65520.0, 65536.0, 1e9, -1e9, np.inf, -np.inf,
     np.nan, -np.nan, 2.0**-14, 2.0**-24, -(2.0**-24), 2.0**-25, 2.0**-25 * 1.0000001, 2.0**-26,
     3 * 2.0**-25, 5 * 2.0**-25, 2.0**-14 - 2.0**-25, 1e-45, 1e-38, 1.00048828125, 1.00146484375,
     0.1, 1 / 3],
    dtype=np.float32,
)


def quiet_float32_patterns(n: int, salt: int) -> np.ndarray:
    """Random float32 bit patterns of every class; signaling NaNs become quiet (hardware and
    software converters legitimately disagree on those)."""
    bits = rng(salt).integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    is_nan = (bits & 0x7F800000) == 0x7F800000
    is_nan &= (bits & 0x007FFFFF) != 0
    bits[is_nan] |= 0x00400000
    return bits.view(np.float32)


def test_f16_matches_numpy_bit_for_bit():
    # near the f16 range, so overflow, normals, subnormals and underflow are all hit
    scaled = (rng(1).standard_normal(200_000) * np.exp2(rng(2).uniform(-28, 17, 200_000))).astype(np.float32)
    x = np.concatenate([F16_EDGES, scaled, quiet_float32_patterns(200_000, 3)])
    x = x[: x.size // 64 * 64].reshape(-1, 64)
    got = native.quantize(TensorType.F16, x).view(np.uint16)
    with np.errstate(over="ignore"):  # overflow to inf is part of what is tested
        want = x.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(got, want)


def test_f16_decodes_every_half_like_numpy():
    halves = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    got = native.dequantize(TensorType.F16, halves, 1024, 64).reshape(-1)
    want = halves.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_bf16_round_to_nearest_even():
    x = np.concatenate([F16_EDGES, gaussian(1, 100_000, 4).ravel(), quiet_float32_patterns(100_000, 5)])
    x = x.reshape(1, -1)
    got = native.quantize(TensorType.BF16, x).view(np.uint16).ravel()
    want = bf16_reference_bits(x.ravel())
    nan = np.isnan(x.ravel())
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert np.isnan(native.dequantize(TensorType.BF16, got[nan], 1, int(nan.sum()))).all()
    # ties go to even: 1 + 2^-8 sits halfway between two bf16 values
    ties = np.array([[1 + 2.0**-8, 1 + 3 * 2.0**-8]], dtype=np.float32)
    assert native.dequantize(TensorType.BF16, native.quantize(TensorType.BF16, ties), 1, 2).tolist() == [
        [1.0, 1 + 2 * 2.0**-7]
    ]


def test_bf16_matches_torch():
    torch = pytest.importorskip("torch")
    x = np.concatenate([F16_EDGES, gaussian(1, 50_000, 6).ravel() * 1e3, quiet_float32_patterns(50_000, 7)])
    x = x[np.isfinite(x) | np.isinf(x)].reshape(1, -1)  # NaN bits differ between torch paths
    got = native.quantize(TensorType.BF16, x).view(np.uint16).ravel()
    want = torch.from_numpy(x.ravel()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(got, want)


def test_f32_roundtrip_is_exact():
    x = np.concatenate([F16_EDGES, quiet_float32_patterns(1024 - F16_EDGES.size, 8)]).reshape(4, -1)
    packed = native.quantize(TensorType.F32, x)
    assert packed.tobytes() == x.tobytes()
    back = native.dequantize(TensorType.F32, packed, *x.shape)
    assert back.tobytes() == x.tobytes()


# ---------------------------------------------------------------------------------------
# q8_0
# ---------------------------------------------------------------------------------------


def test_q8_0_bytes_match_ggml_rule():
    x = np.concatenate([gaussian(6, 256, 9), gaussian(2, 256, 10, scale=1e-3), np.zeros((1, 256), np.float32)])
    x[7, :32] = 0.0  # one all-zero block
    x[3, 32:64] = np.linspace(-127, 127, 32, dtype=np.float32)  # exact integers and ties
    np.testing.assert_array_equal(native.quantize(TensorType.Q8_0, x), q8_0_reference(x))


def test_q8_0_error_within_half_step():
    x = gaussian(64, 512, 11)
    packed = native.quantize(TensorType.Q8_0, x)
    back = native.dequantize(TensorType.Q8_0, packed, *x.shape)
    blocks = x.reshape(64, -1, 32)
    d32 = np.abs(blocks).max(axis=2) / np.float32(127)  # the scale before f16 storage
    d16 = f16_value(packed.reshape(64, -1, 34)[..., :2].copy().view(np.uint16)[..., 0])
    q = packed.reshape(64, -1, 34)[..., 2:].view(np.int8).astype(np.float32)
    # half a step, plus what storing the scale as f16 moves each level
    bound = 0.5 * d32[..., None] + np.abs(q) * np.abs(d32 - d16)[..., None] + 1e-7
    err = np.abs(back.reshape(64, -1, 32) - blocks)
    assert (err <= bound).all()
    np.testing.assert_allclose(back.reshape(64, -1, 32), d16[..., None] * q, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------
# q4_g64
# ---------------------------------------------------------------------------------------


def test_q4_g64_nibble_layout_decode():
    block = np.zeros(36, dtype=np.uint8)
    block[0:2] = np.array([0.5], dtype=np.float16).view(np.uint8)  # d
    block[2:4] = np.array([-2.0], dtype=np.float16).view(np.uint8)  # m
    j = np.arange(32)
    block[4:] = (j % 16) | ((15 - j % 16) << 4)
    got = native.dequantize(TensorType.Q4_G64, block, 1, 64).ravel()
    want = np.concatenate([0.5 * (j % 16) - 2.0, 0.5 * (15 - j % 16) - 2.0]).astype(np.float32)
    np.testing.assert_array_equal(got, want)


def test_q4_g64_nibble_layout_encode():
    j = np.arange(32)
    x = np.concatenate([j % 16, 15 - j % 16]).astype(np.float32).reshape(1, 64)
    block = native.quantize(TensorType.Q4_G64, x).ravel()
    assert block[0:2].tobytes() == np.float16(1.0).tobytes()  # d = 1
    assert block[2:4].tobytes() == np.float16(0.0).tobytes()  # m = 0
    assert block[4:].tolist() == [int(a) | (int(b) << 4) for a, b in zip(j % 16, 15 - j % 16)]


def test_q4_g64_constant_blocks():
    x = np.stack([np.full(64, v, np.float32) for v in (0.0, 0.75, -3.3, 1000.1)])
    packed = native.quantize(TensorType.Q4_G64, x)
    d, m, q = q4_blocks(packed)
    assert (d == 0).all() and (q == 0).all()
    np.testing.assert_array_equal(m[:, 0], x[:, 0].astype(np.float16).astype(np.float32))
    back = native.dequantize(TensorType.Q4_G64, packed, *x.shape)
    np.testing.assert_array_equal(back, np.repeat(m, 64, axis=1))


def q4_check_error_bound(x: np.ndarray) -> None:
    packed = native.quantize(TensorType.Q4_G64, x)
    back = native.dequantize(TensorType.Q4_G64, packed, *x.shape)
    d, m, q = q4_blocks(packed)
    assert (q <= 15).all() and (d >= 0).all()
    rows = x.shape[0]
    err = np.abs(back - x).reshape(rows, -1, 64)
    # half a step, plus a couple of float32 ulps for computing d * q + m
    slack = 2.0**-22 * (np.abs(m) + 15 * d)
    assert (err <= (0.5 * d + slack)[..., None]).all()
    # decoding is exactly d * q + m in float32
    np.testing.assert_array_equal(back.reshape(rows, -1, 64), d[..., None] * q.astype(np.float32) + m[..., None])


def test_q4_g64_error_within_half_step():
    q4_check_error_bound(gaussian(32, 512, 12))


def test_q4_g64_error_bound_on_hard_blocks():
    r = rng(13)
    hard = [
        1000 + 0.01 * r.standard_normal(64),  # spread far below the f16 ulp of the offset
        -1000 + 0.01 * r.standard_normal(64),
        np.r_[r.standard_normal(63) * 1e-3, 50.0],  # one outlier
        r.uniform(-65000, 65000, 64),  # the edge of the f16 range
        r.standard_normal(64) * 1e-6,  # scale in f16 subnormals
        np.r_[np.zeros(63), 1e-7],  # step smaller than the smallest f16
        np.where(r.random(64) < 0.5, -1.0, 1.0),  # two values
    ]
    q4_check_error_bound(np.stack(hard).astype(np.float32))


def test_q4_g64_beats_minmax_and_is_deterministic():
    x = gaussian(128, 1024, 14)
    packed = native.quantize(TensorType.Q4_G64, x)
    assert np.array_equal(packed, native.quantize(TensorType.Q4_G64, x))
    ours = np.mean((native.dequantize(TensorType.Q4_G64, packed, *x.shape) - x) ** 2)
    minmax = np.mean((q4_minmax_dequant(x) - x) ** 2)
    print(f"\nq4_g64 MSE {ours:.6f} vs plain min/max {minmax:.6f} ({ours / minmax:.3f}x)")
    assert ours < 0.95 * minmax


# ---------------------------------------------------------------------------------------
# mxfp4
# ---------------------------------------------------------------------------------------

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def mxfp4_block(e: int, codes) -> np.ndarray:
    """One 17-byte block: exponent byte e, element j's code in the low nibble of byte 1 + j
    and element j + 16's in its high nibble."""
    codes = np.asarray(codes, dtype=np.uint8)
    return np.concatenate([[e], codes[:16] | (codes[16:] << 4)]).astype(np.uint8)


def test_mxfp4_decodes_every_code_at_every_exponent_exactly():
    """value = e2m1(code) * 2^(e - 127) bit for bit, signed zeros included, for all 256
    exponent bytes (255 decodes as 2^128, as ldexp does: 6 * 2^128 overflows to inf)."""
    codes = np.arange(32) % 16
    blocks = np.stack([mxfp4_block(e, codes) for e in range(256)])
    got = native.dequantize(TensorType.MXFP4, blocks, 256, 32)
    with np.errstate(over="ignore"):
        want = np.stack([np.ldexp(E2M1[codes], np.int32(e - 127)).astype(np.float32) for e in range(256)])
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.isinf(got[255, 7]) and got[255, 1] == np.float32(2.0**127)


def test_mxfp4_nibble_layout_encode():
    """Values that are e2m1 values times one power of two encode exactly, element j in the
    low nibble of byte j, element j + 16 in the high one."""
    codes = (np.arange(32) * 7) % 16
    codes[codes == 8] = 0  # -0 encodes as +0
    codes[3] = 7  # a 6 (largest) so the OCP exponent is the exact one
    x = (E2M1[codes] * np.float32(2.0**-3)).reshape(1, 32)
    block = native.quantize(TensorType.MXFP4, x).ravel()
    np.testing.assert_array_equal(block, mxfp4_block(127 - 3, codes))
    np.testing.assert_array_equal(native.dequantize(TensorType.MXFP4, block, 1, 32), x)


def test_mxfp4_rounds_to_the_nearest_code_ties_to_even():
    # with max 6 the OCP exponent is 2^0: midpoints tie to the code with an even mantissa bit
    x = np.array([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, 0.3, -5.1] + [0] * 20, np.float32)
    back = native.dequantize(TensorType.MXFP4, native.quantize(TensorType.MXFP4, x.reshape(1, 32)), 1, 32).ravel()
    np.testing.assert_array_equal(back[:12], [6, 0, 1, 1, 2, 2, 4, 4, 0, -2, 0.5, -6])


def test_mxfp4_picks_the_exponent_with_the_lower_error():
    # max 7.9: the OCP exponent (2^0) clips it to 6 (error 1.9); 2^1 holds it as 8 (error 0.1)
    clipped = np.array([7.9] + [0.0] * 31, np.float32).reshape(1, 32)
    packed = native.quantize(TensorType.MXFP4, clipped)
    assert packed[0, 0] == 128 and native.dequantize(TensorType.MXFP4, packed, 1, 32)[0, 0] == 8.0
    # max 6.1 with small values: 2^0 keeps 0.5-steps for the rest, clipping 6.1 costs only 0.1
    fine = np.array([6.1] + [0.5, 1.5, -0.5] * 10 + [0.0], np.float32).reshape(1, 32)
    packed = native.quantize(TensorType.MXFP4, fine)
    assert packed[0, 0] == 127
    # a zero block and a tiny one (exponent clamped at the smallest scale)
    for x in (np.zeros((1, 32), np.float32), np.full((1, 32), 1e-42, np.float32)):
        packed = native.quantize(TensorType.MXFP4, x)
        assert packed[0, 0] == 0
        assert np.abs(native.dequantize(TensorType.MXFP4, packed, 1, 32) - x).max() <= 2.0**-128


def test_mxfp4_error_is_at_most_the_plain_ocp_rule():
    x = gaussian(64, 1024, 16) * np.exp2(rng(17).uniform(-20, 20, (64, 1))).astype(np.float32)
    packed = native.quantize(TensorType.MXFP4, x)
    assert np.array_equal(packed, native.quantize(TensorType.MXFP4, x))  # deterministic
    back = native.dequantize(TensorType.MXFP4, packed, *x.shape)
    # the OCP rule alone: exponent floor(log2(max)) - 2, nearest e2m1 value, saturating at 6
    blocks = x.reshape(-1, 32).astype(np.float64)
    scale = np.exp2(np.floor(np.log2(np.abs(blocks).max(axis=1))) - 2)[:, None]
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    nearest = grid[np.abs(np.abs(blocks / scale)[..., None] - grid).argmin(axis=-1)]
    ocp = np.sign(blocks) * nearest * scale
    ours = ((back.reshape(-1, 32) - blocks) ** 2).sum(axis=1)
    theirs = ((ocp - blocks) ** 2).sum(axis=1)
    assert (ours <= theirs * (1 + 1e-6)).all()
    print(f"\nmxfp4 MSE {ours.sum() / theirs.sum():.3f}x the plain OCP rule's")


def test_quantization_error_report():
    """Relative RMS error on gaussian data (printed with -s, documented in docs/format.md)."""
    x = gaussian(256, 4096, 15)
    report = {}
    for t in (TensorType.F16, TensorType.BF16, TensorType.Q8_0, TensorType.Q4_G64, TensorType.MXFP4):
        back = native.dequantize(t, native.quantize(t, x), *x.shape)
        report[t.name_in_pack] = rel_rms(back - x, x)
    print("\nrelative RMS error on N(0,1) data, 256x4096: " + ", ".join(f"{k} {v:.5f}" for k, v in report.items()))
    assert report["q8_0"] < 0.01
    assert report["q4_g64"] < 0.12
    assert report["mxfp4"] < 0.13


# ---------------------------------------------------------------------------------------
# matmul and get_rows
# ---------------------------------------------------------------------------------------

MATMUL_SHAPES = [  # (n_out, n_in, n_tok)
    (1, 64, 1),
    (37, 128, 1),
    (100, 192, 3),
    (257, 320, 7),
    (13, 1024, 2),
    (65, 64, 33),
]


@pytest.fixture
def portable_kernels():
    """The reference level for one test (the SIMD levels are tested against it in
    tests/native/test_kernels.py)."""
    before = native.kernels()
    native.set_kernels("portable")
    yield
    native.set_kernels(before)


@pytest.mark.parametrize("type_", ALL_TYPES, ids=lambda t: t.name_in_pack)
@pytest.mark.parametrize("shape", MATMUL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matmul_matches_numpy(type_, shape, portable_kernels):
    n_out, n_in, n_tok = shape
    w = gaussian(n_out, n_in, 16 + n_out)
    x = gaussian(n_tok, n_in, 17 + n_tok)
    packed = native.quantize(type_, w)
    w_deq = native.dequantize(type_, packed, n_out, n_in).astype(np.float64)
    y = native.matmul(type_, packed, n_out, n_in, x)
    assert y.shape == (n_tok, n_out) and y.dtype == np.float32
    want = x.astype(np.float64) @ w_deq.T
    scale = np.abs(x).astype(np.float64) @ np.abs(w_deq).T  # error is relative to this
    assert (np.abs(y - want) <= 1e-5 * scale).all()


def test_matmul_accepts_any_buffer_and_alignment():
    w = gaussian(9, 128, 18)
    x = gaussian(4, 256, 19)[:, ::2]  # non-contiguous x is copied
    for t in ALL_TYPES:
        packed = native.quantize(t, w)
        want = native.matmul(t, packed, 9, 128, np.ascontiguousarray(x))
        shifted = bytearray(b"\0" + packed.tobytes())  # odd address for every block
        view = memoryview(shifted)[1:]
        np.testing.assert_array_equal(native.matmul(t, view, 9, 128, x), want)
        np.testing.assert_array_equal(native.dequantize(t, view, 9, 128), native.dequantize(t, packed, 9, 128))


@pytest.mark.parametrize("type_", ALL_TYPES, ids=lambda t: t.name_in_pack)
def test_get_rows(type_):
    table = gaussian(50, 128, 20)
    packed = native.quantize(type_, table)
    ids = np.array([0, 49, 7, 7, 23], dtype=np.int64)
    got = native.get_rows(type_, packed, 128, ids)
    np.testing.assert_array_equal(got, native.dequantize(type_, packed, 50, 128)[ids])
    assert native.get_rows(type_, packed, 128, np.array([], dtype=np.int32)).shape == (0, 128)
    with pytest.raises(native.InvalidArgumentError):
        native.get_rows(type_, packed, 128, [50])
    with pytest.raises(native.InvalidArgumentError):
        native.get_rows(type_, packed, 128, [-1])


# ---------------------------------------------------------------------------------------
# crc32c
# ---------------------------------------------------------------------------------------

CRC32C_VECTORS = [  # (data, crc) — "123456789" is the standard check value, the rest RFC 3720
    (b"123456789", 0xE3069283),
    (b"", 0x00000000),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
]


@pytest.mark.parametrize("crc_fn", [native.crc32c, native.crc32c_software], ids=["default", "software"])
def test_crc32c_known_vectors(crc_fn):
    for data, want in CRC32C_VECTORS:
        assert crc_fn(data) == want, data


def test_crc32c_chaining_and_buffer_kinds(tmp_path):
    data = rng(21).integers(0, 256, 10_007, dtype=np.uint8).tobytes()
    whole = native.crc32c(data)
    for cut in (0, 1, 7, 8, 4096, 10_006, 10_007):
        assert native.crc32c(data[cut:], native.crc32c(data[:cut])) == whole
    assert native.crc32c(np.frombuffer(data, np.uint8)) == whole
    assert native.crc32c(memoryview(data)) == whole
    assert native.crc32c(bytearray(data)) == whole
    path = tmp_path / "blob"
    path.write_bytes(data)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        assert native.crc32c(mm) == whole  # read-only map: no copy, no writable buffer needed


def test_crc32c_hardware_equals_software():
    if not native.crc32c_uses_hardware():
        pytest.skip("no SSE4.2 on this CPU: crc32c is the software path")
    data = rng(22).integers(0, 256, 5000, dtype=np.uint8)  # views of it keep their offset
    for start in range(9):  # every alignment of the 8-byte loop
        for length in (0, 1, 5, 8, 15, 16, 63, 64, 1000, 4991 - start):
            chunk = data[start : start + length]
            assert native.crc32c(chunk, 0x1234) == native.crc32c_software(chunk, 0x1234)
            assert native.crc32c(chunk) == native.crc32c_software(chunk)


CRC32C_BLOCK = 16384  # CRC32C_BLOCK_BYTES in crc32c.c: the hardware path runs rounds of 3 blocks
CRC32C_ROUND = 3 * CRC32C_BLOCK
CRC32C_RESIDUE = 0x48674BC7  # crc(m || crc(m) as 4 little-endian bytes), the same for every m


def crc32c_python(data: bytes, crc: int = 0) -> int:
    """Byte-at-a-time table CRC-32C: a reference that shares no code with libcolibri."""
    table = []
    for byte in range(256):
        c = byte
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        table.append(c)
    c = crc ^ 0xFFFFFFFF
    for byte in data:
        c = (c >> 8) ^ table[(c ^ byte) & 0xFF]
    return c ^ 0xFFFFFFFF


def test_crc32c_python_reference_is_standard():
    assert crc32c_python(b"123456789") == 0xE3069283
    for data, want in CRC32C_VECTORS:
        assert crc32c_python(data) == want


def test_crc32c_three_chain_rounds_equal_software():
    if not native.crc32c_uses_hardware():
        pytest.skip("no SSE4.2 on this CPU: crc32c is the software path")
    data = rng(23).integers(0, 256, 7 * CRC32C_ROUND + 64, dtype=np.uint8)
    lengths = [0, 1, 7, 8, CRC32C_ROUND - 1, CRC32C_ROUND, CRC32C_ROUND + 1, CRC32C_ROUND + 8,
               2 * CRC32C_ROUND - 1, 3 * CRC32C_ROUND + 13, 7 * CRC32C_ROUND - 5, 7 * CRC32C_ROUND + 61]
    for start in (0, 1, 3, 8, 13):  # unaligned start pointers: the views keep the offset
        assert data[start:].ctypes.data % 8 == (data.ctypes.data + start) % 8
        for length in lengths:
            chunk = data[start : start + length]
            want = native.crc32c_software(chunk)
            assert native.crc32c(chunk) == want, (start, length)
            assert native.crc32c(chunk, 0xDEADBEEF) == native.crc32c_software(chunk, 0xDEADBEEF)
            with_crc = chunk.tobytes() + want.to_bytes(4, "little")
            assert native.crc32c(with_crc) == CRC32C_RESIDUE, (start, length)
    for length in (CRC32C_ROUND + 1, 2 * CRC32C_ROUND + 7):  # independent of libcolibri
        chunk = data[5 : 5 + length]
        assert native.crc32c(chunk) == crc32c_python(chunk.tobytes()), length


def test_crc32c_chains_across_a_round_boundary():
    data = rng(24).integers(0, 256, 3 * CRC32C_ROUND + 3, dtype=np.uint8)
    whole = native.crc32c_software(data)
    for cut in (1, CRC32C_BLOCK, CRC32C_ROUND - 3, CRC32C_ROUND, CRC32C_ROUND + 5,
                2 * CRC32C_ROUND + CRC32C_BLOCK + 1):
        assert native.crc32c(data[cut:], native.crc32c(data[:cut])) == whole, cut


# ---------------------------------------------------------------------------------------
# Invalid arguments: typed exceptions, never a crash
# ---------------------------------------------------------------------------------------


def test_status_codes_become_typed_exceptions():
    native.check(0)
    for status, cls in [(1, native.InvalidArgumentError), (2, native.OutOfMemoryError),
                        (3, native.ValueRangeError), (4, native.NotSupportedError), (99, native.ColibriError)]:
        with pytest.raises(cls) as info:
            native.check(status)
        assert isinstance(info.value, native.ColibriError) and info.value.status == status


def test_c_entry_points_reject_bad_arguments():
    lib = native._lib()
    x = gaussian(2, 64, 23)
    out = np.empty(1024, dtype=np.uint8)
    f32_out = np.empty(1024, dtype=np.float32)
    assert lib.col_quantize(99, x.ctypes.data, 2, 64, out.ctypes.data) == 1  # bad type
    assert lib.col_quantize(-1, x.ctypes.data, 2, 64, out.ctypes.data) == 1
    assert lib.col_quantize(int(TensorType.Q8_0), x.ctypes.data, 2, 33, out.ctypes.data) == 1
    assert lib.col_quantize(int(TensorType.F32), None, 2, 64, out.ctypes.data) == 1  # NULL
    assert lib.col_quantize(int(TensorType.F32), x.ctypes.data, -2, 64, out.ctypes.data) == 1
    assert lib.col_dequantize(int(TensorType.Q4_G64), out.ctypes.data, 1, 32, f32_out.ctypes.data) == 1
    assert lib.col_matmul(None, int(TensorType.Q8_0), out.ctypes.data, 4, 48, x.ctypes.data, 1, f32_out.ctypes.data) == 1
    assert lib.col_matmul(None, int(TensorType.F32), None, 4, 64, None, 1, None) == 1
    assert lib.col_get_rows(7, out.ctypes.data, 64, None, 1, f32_out.ctypes.data) == 1
    assert lib.col_type_row_bytes(int(TensorType.Q4_G64), 65) == -1
    assert lib.col_type_block_elems(6) == -1
    assert lib.col_status_string(1) == b"invalid argument"
    assert lib.col_status_string(-7) == b"unknown status"
    with pytest.raises(native.InvalidArgumentError):
        native.check(lib.col_quantize(99, x.ctypes.data, 2, 64, out.ctypes.data))


def test_wrappers_reject_bad_arguments():
    x = gaussian(2, 64, 24)
    Err = native.InvalidArgumentError
    with pytest.raises(Err):
        TensorType.from_name("q5_k")
    with pytest.raises(Err):
        native.quantize(9, x)
    with pytest.raises(Err):
        native.quantize(TensorType.Q8_0, gaussian(2, 48, 25))  # cols not a multiple of 32
    with pytest.raises(Err):
        TensorType.Q4_G64.row_bytes(96)
    with pytest.raises(Err):
        native.quantize(TensorType.F16, x.astype(np.float64))
    with pytest.raises(Err):
        native.quantize(TensorType.F16, x.ravel())
    with pytest.raises(Err):
        native.quantize(TensorType.F16, x.tolist())
    packed = native.quantize("q8_0", x)
    with pytest.raises(Err):
        native.dequantize(TensorType.Q8_0, packed, 3, 64)  # too few bytes
    with pytest.raises(Err):
        native.dequantize(TensorType.Q8_0, packed, -1, 64)
    with pytest.raises(Err):
        native.matmul(TensorType.Q8_0, packed, 2, 64, gaussian(1, 32, 26))  # x has wrong width
    with pytest.raises(Err):
        native.matmul(TensorType.Q8_0, packed[:, ::2], 2, 64, x)  # non-contiguous weights
    with pytest.raises(Err):
        native.crc32c(memoryview(b"abcdef")[::2])
    with pytest.raises(Err):
        native.crc32c(b"abc", crc=-1)


def test_unrepresentable_values_raise_range_error():
    for t in (TensorType.Q8_0, TensorType.Q4_G64, TensorType.MXFP4):
        for bad in (np.nan, np.inf, -np.inf):
            x = gaussian(1, 128, 27)
            x[0, 70] = bad
            with pytest.raises(native.ValueRangeError):
                native.quantize(t, x)
    x = gaussian(1, 64, 28)
    x[0, 3] = 1e6  # no f16 offset/scale can reach it
    with pytest.raises(native.ValueRangeError):
        native.quantize(TensorType.Q4_G64, x)
    with pytest.raises(native.ValueRangeError):
        native.quantize(TensorType.Q8_0, np.full((1, 32), 1e7, np.float32))  # scale > 65504


def test_empty_shapes():
    for t in ALL_TYPES:
        block = t.block_elems
        assert native.quantize(t, np.zeros((0, block), np.float32)).shape == (0, t.row_bytes(block))
        assert native.dequantize(t, b"", 0, block).shape == (0, block)
        assert native.matmul(t, b"", 0, block, np.zeros((3, block), np.float32)).shape == (3, 0)
        y = native.matmul(t, native.quantize(t, np.ones((2, block), np.float32)), 2, block, np.zeros((0, block), np.float32))
        assert y.shape == (0, 2)
    assert native.matmul(TensorType.F32, b"", 4, 0, np.zeros((2, 0), np.float32)).tolist() == [[0.0] * 4] * 2


def test_io_priority_is_per_thread_and_inherited_by_the_loaders_threads(tmp_path):
    """The daemon's verify lowers its thread's I/O class, then starts a loader: the loader's I/O
    threads must read at the lowered priority too, and the rest of the process keep its own."""
    import os
    import threading

    from colibrid import native

    path = tmp_path / "file"
    path.write_bytes(b"\0" * 8192)
    before = native.get_io_priority()
    seen = {}

    def lowered():
        tasks = set(os.listdir("/proc/self/task"))
        native.set_io_priority(native.IoClass.IDLE)
        loader = native.Loader(path, queue_depth=2, max_queue_depth=2)
        started = set(os.listdir("/proc/self/task")) - tasks
        seen["self"] = native.get_io_priority()
        seen["loader"] = [native.get_io_priority(int(tid)) for tid in started]
        loader.close()

    thread = threading.Thread(target=lowered)
    thread.start()
    thread.join()
    assert seen["self"] == (native.IoClass.IDLE, 0)
    assert len(seen["loader"]) == 2 and set(seen["loader"]) == {(native.IoClass.IDLE, 0)}
    assert native.get_io_priority() == before  # this thread's is its own
