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
from colibrid.models.tensor_ref import TensorRef  # noqa: E402
from colibrid.tools.convert.safetensors import Checkpoint, CheckpointError  # noqa: E402

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


# ---------------------------------------------------------------------------------------
# A whole model: FP8 attention, MXFP4 experts
# ---------------------------------------------------------------------------------------

SPEC_OVERRIDES = {"num_hidden_layers": 2}
FP8_BLOCK = (48, 40)  # small blocks, so the 64-wide tiny matrices have partial edge blocks


def _published_quantized(packs, tmp_path):
    """(quantized checkpoint dir, same model with the decoded weights in f32) from a tiny
    qwen3_moe: every expert matrix replaced by random MXFP4 codes, every attention matrix
    by random FP8 codes with block scales."""
    from safetensors.numpy import load_file, save_file

    from tests.tiny_checkpoints import CheckpointSpec

    source = packs.checkpoint(CheckpointSpec("qwen3_moe", SPEC_OVERRIDES, seed=3))
    state = load_file(source / "model.safetensors")
    quantized, decoded = {}, {}
    for i, (name, array) in enumerate(sorted(state.items())):
        if ".mlp.experts." in name:
            rows, cols = array.shape
            blocks, scales = random_mxfp4((1, rows, cols // 32), 100 + i)
            base = name  # e.g. model.layers.0.mlp.experts.3.gate_proj.weight
            quantized[base + "_blocks"], quantized[base + "_scales"] = ("U8", blocks[0]), ("U8", scales[0])
            decoded[name] = oracle_mxfp4(blocks, scales)[0]
        elif ".self_attn." in name and name.endswith("proj.weight"):
            codes = random_e4m3(array.shape, 100 + i)
            grid = (-(-array.shape[0] // FP8_BLOCK[0]), -(-array.shape[1] // FP8_BLOCK[1]))
            scale = np.random.default_rng(i).uniform(2e-4, 1e-3, grid).astype(np.float32)  # e4m3 reaches 448
            quantized[name], quantized[name + "_scale_inv"] = ("F8_E4M3", codes), ("F32", scale)
            decoded[name] = oracle_fp8(codes, scale, FP8_BLOCK)
        else:
            quantized[name], decoded[name] = ("F32", array), array
    out, ref = tmp_path / "published", tmp_path / "decoded"
    for directory in (out, ref):
        directory.mkdir()
        for f in source.iterdir():
            if f.name != "model.safetensors":
                (directory / f.name).write_bytes(f.read_bytes())
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(FP8_BLOCK)}
    (out / "config.json").write_text(json.dumps(config))
    write_safetensors(out / "model.safetensors", quantized)
    save_file({k: np.ascontiguousarray(v) for k, v in decoded.items()}, str(ref / "model.safetensors"), metadata={"format": "pt"})
    return out, ref, decoded


def test_fp8_attention_and_mxfp4_experts_convert_and_match_transformers(packs, tmp_path):
    from colibrid.tools.convert.converter import convert
    from colibrid.tools.convert.quant_spec import parse_quant
    from colibrid.engine import load
    from colibrid.engine.experts.source import PreadExpertSource
    from colibrid.pack import Pack
    from tests.tiny_checkpoints import load_reference, reference_greedy, reference_logits

    published, decoded_dir, decoded = _published_quantized(packs, tmp_path)
    out = tmp_path / "pack"
    convert(published, out, parse_quant("dense=f32,embeddings=f32"), progress=False)  # experts: as published
    pack = Pack.open(out)
    assert pack.manifest.quantization["experts"] == "mxfp4"
    # dense: the FP8 values exactly; experts: the published codes, decoding to the oracle's values
    np.testing.assert_array_equal(pack.dense("layers.1.attn.q").data, decoded["model.layers.1.self_attn.q_proj.weight"])

    source = PreadExpertSource(pack)
    expert = source.get(1, 5)
    for part, hf in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
        t = getattr(expert, part)
        assert t.type is native.TensorType.MXFP4
        np.testing.assert_array_equal(native.dequantize(t.type, t.data, *t.shape), decoded[f"model.layers.1.mlp.experts.5.{hf}.weight"])
    source.close()

    reference = load_reference(decoded_dir)
    ids = np.random.default_rng(1).integers(0, reference.config.vocab_size, 32).tolist()
    expected = reference_logits(reference, ids)
    before = native.kernels()
    try:
        native.set_kernels("portable")  # float activations: the same model as transformers'
        engine = load(out)
        actual = engine.forward(ids)
        assert np.abs(actual - expected).max() <= 1e-4 * np.abs(expected).max()
        assert engine.greedy(ids, 32) == reference_greedy(reference, ids, 32)
        # (the SIMD levels quantize activations to int8: measured against this level, within
        # that bound, by tests/native/test_kernels.py; on a random model a perturbation that
        # flips one routing choice changes that position's logits entirely)
    finally:
        native.set_kernels(before)


def test_explicit_experts_type_reencodes_mxfp4_experts(packs, tmp_path):
    from colibrid.tools.convert.converter import convert
    from colibrid.tools.convert.quant_spec import parse_quant
    from colibrid.pack import Pack

    published, _, _ = _published_quantized(packs, tmp_path)
    convert(published, tmp_path / "q8", parse_quant("experts=q8_0"), progress=False)
    assert Pack.open(tmp_path / "q8").manifest.quantization["experts"] == "q8_0"


def test_unknown_quantization_methods_are_refused(packs, tmp_path):
    from colibrid.tools.convert.converter import ConversionError, convert
    from colibrid.tools.convert.quant_spec import parse_quant

    published, _, _ = _published_quantized(packs, tmp_path)
    config = json.loads((published / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (published / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match="quant_method 'gptq' is not supported"):
        convert(published, tmp_path / "out", parse_quant(None), progress=False)
