"""Checkpoints published quantized convert from the bytes as published.

The tests write the safetensors bytes themselves, from codes and scales they choose, and
compare with transformers' own decoders (the oracle): FP8 (float8_e4m3fn with
``weight_scale_inv`` block scales, partial edge blocks included) reads exactly as
transformers' fine-grained FP8 integration dequantizes it; an MXFP4 tensor
(``_blocks`` / ``_scales``) reads exactly as transformers' integrations/mxfp4.py decodes it,
and its pack bytes are the published codes and exponents, only rearranged. A tiny model
whose attention is FP8 and whose experts are MXFP4 converts (experts copied as mxfp4) and
generates the same 32 greedy tokens as transformers with the decoded weights.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from colibrid import native  # noqa: E402
from colibrid.convert.safetensors import Checkpoint, CheckpointError, TensorRef  # noqa: E402

_NUMPY_DTYPE = {"F32": np.float32, "BF16": np.uint16, "F8_E4M3": np.uint8, "U8": np.uint8}


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """The safetensors format by hand: u64 header length, JSON header, raw little-endian data."""
    header, chunks, offset = {}, [], 0
    for name, (dtype, array) in tensors.items():
        data = np.ascontiguousarray(array, dtype=_NUMPY_DTYPE[dtype]).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(chunks))


def random_e4m3(shape, seed) -> np.ndarray:
    """float8_e4m3fn codes of every finite value (0x7f / 0xff are NaN)."""
    codes = np.random.default_rng(seed).integers(0, 256, shape).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C
    return codes


def oracle_fp8(codes: np.ndarray, scale_inv: np.ndarray, block) -> np.ndarray:
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    weight = torch.from_numpy(codes).view(torch.float8_e4m3fn)
    return _dequantize_fp8_weight(weight, torch.from_numpy(scale_inv), list(block), torch.float32).numpy()


def oracle_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """(E, R, C) values; transformers returns them transposed, (E, C, R), as gpt-oss uses them."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    out = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    return out.transpose(1, 2).contiguous().numpy()


def random_mxfp4(shape_e_r_g, seed, exponents=(120, 126)) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, shape_e_r_g + (16,)).astype(np.uint8)
    scales = rng.integers(exponents[0], exponents[1] + 1, shape_e_r_g).astype(np.uint8)
    return blocks, scales


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def test_fp8_block_scaled_tensors_read_exactly(tmp_path):
    # 300 x 200 in 128 x 128 blocks: a 3 x 2 grid whose last row and column are partial
    codes = random_e4m3((300, 200), 1)
    scale = np.float32([[0.5, 2.0**-9], [3.0, 1.0], [2.0**7, 0.1]])
    fused = random_e4m3((2, 130, 140), 2)  # (E, R, C) with per-expert block scales
    fused_scale = np.random.default_rng(3).uniform(0.01, 2, (2, 2, 2)).astype(np.float32)
    write_safetensors(tmp_path / "model.safetensors", {
        "w.weight": ("F8_E4M3", codes), "w.weight_scale_inv": ("F32", scale),
        "experts.down": ("F8_E4M3", fused), "experts.down_scale_inv": ("F32", fused_scale),
        "raw.weight": ("F8_E4M3", codes[:4, :8]),  # no scale: the plain e4m3 values
    })
    ck = Checkpoint(tmp_path)
    got = ck.read_f32("w.weight")
    np.testing.assert_array_equal(bits(got), bits(oracle_fp8(codes, scale, (128, 128))))
    # the known values: every e4m3 value times its block's factor (here products are exact in f64)
    values = torch.from_numpy(codes).view(torch.float8_e4m3fn).to(torch.float64).numpy()
    factor = np.repeat(np.repeat(scale.astype(np.float64), 128, 0)[:300], 128, 1)[:, :200]
    np.testing.assert_array_equal(got, (values * factor).astype(np.float32))
    assert np.isin(codes, [0x00, 0x01, 0x7E, 0x80, 0xFE]).sum() > 0  # zero, subnormal, 448 and negatives occur

    want = oracle_fp8(fused, fused_scale, (128, 128))
    np.testing.assert_array_equal(bits(ck.read_f32(TensorRef("experts.down", (1,)))), bits(want[1]))
    np.testing.assert_array_equal(bits(ck.read_f32(TensorRef("experts.down", (0,), slice(1, None, 2)))), bits(want[0, 1::2]))
    np.testing.assert_array_equal(ck.read_f32("raw.weight"),
                                  torch.from_numpy(codes[:4, :8]).view(torch.float8_e4m3fn).float().numpy())
    assert Checkpoint(tmp_path, fp8_block=(64, 64)) is not None
    with pytest.raises(CheckpointError, match="scale_inv has shape"):
        Checkpoint(tmp_path, fp8_block=(64, 64)).read_f32("w.weight")


def test_mxfp4_tensors_read_exactly_and_pack_losslessly(tmp_path):
    blocks, scales = random_mxfp4((2, 6, 3), 4, exponents=(0, 254))
    scales[0, 0, :] = [0, 1, 255]  # the smallest scales and the one transformers decodes as 2^128
    write_safetensors(tmp_path / "model.safetensors", {
        "mlp.experts.gate_up_proj_blocks": ("U8", blocks), "mlp.experts.gate_up_proj_scales": ("U8", scales),
    })
    ck = Checkpoint(tmp_path)
    name = "mlp.experts.gate_up_proj"
    assert ck.is_mxfp4(name) and ck.shape_of(name) == (2, 6, 96)
    want = oracle_mxfp4(blocks, scales)
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(bits(ck.read_f32(name)), bits(want))
    # one expert's even rows (gate) and odd rows (up) of an interleaved gate_up, as pack rows
    for rows in (slice(0, None, 2), slice(1, None, 2)):
        ref = TensorRef(name, (1,), rows)
        packed = ck.read_mxfp4(ref)
        assert packed.shape == (3, 3 * 17) and ck.shape_of(ref) == (3, 96)
        np.testing.assert_array_equal(bits(native.dequantize(native.TensorType.MXFP4, packed, 3, 96)), bits(want[1, rows]))
        # the pack block byte by byte: the exponent, then element j | element j + 16 << 4
        codes = np.stack([blocks[1, rows] & 15, blocks[1, rows] >> 4], axis=-1).reshape(3, 3, 32)
        expect = np.concatenate([scales[1, rows][..., None], codes[..., :16] | (codes[..., 16:] << 4)], axis=-1)
        np.testing.assert_array_equal(packed, expect.reshape(3, 51))


def test_mismatched_mxfp4_pairs_and_raw_bytes_are_named(tmp_path):
    blocks, scales = random_mxfp4((4, 2), 5)
    write_safetensors(tmp_path / "model.safetensors", {"x_blocks": ("U8", blocks), "x_scales": ("U8", scales[:3])})
    with pytest.raises(CheckpointError, match="MXFP4 tensor x"):
        Checkpoint(tmp_path)
    write_safetensors(tmp_path / "model.safetensors", {"y_blocks": ("U8", blocks)})
    with pytest.raises(CheckpointError, match="raw bytes"):
        Checkpoint(tmp_path).read_f32("y_blocks")
