"""FP8 checkpoints: float8_e4m3fn values and the block scales DeepSeek-V3 / Kimi K2 publish.

Such a checkpoint stores a linear weight W (R, C) as e4m3 codes plus ``weight_scale_inv``
(ceil(R / b0), ceil(C / b1)) float32, one factor per b0 x b1 block (128 x 128, from
``quantization_config.weight_block_size``); the last block of a row or column may be
partial. The value is ``e4m3(W[r, c]) * scale_inv[r // b0, c // b1]``, a float32 product
rounded once (what transformers' fine-grained FP8 integration computes). Dequantized here
one tensor at a time while converting, then encoded as ``--quant`` says.
"""

from __future__ import annotations

import numpy as np

DEFAULT_BLOCK = (128, 128)
SUPPORTED_QUANT_METHODS = ("fp8", "mxfp4")  # how a checkpoint may be published quantized


def _e4m3_table() -> np.ndarray:
    """(256) float32: the value of every float8_e4m3fn byte (bias 7, no infinities; exponent
    and mantissa all ones is NaN; exponent 0 is subnormal: mantissa / 8 * 2^-6)."""
    code = np.arange(256)
    sign = np.where(code & 0x80, -1.0, 1.0)
    exponent, mantissa = (code >> 3) & 0x0F, code & 0x07
    magnitude = np.where(exponent == 0, mantissa / 8.0 * 2.0**-6, (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0))
    values = sign * magnitude
    values[(code & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)  # every value is exact in float32


E4M3_VALUES = _e4m3_table()


def decode_e4m3(codes: np.ndarray) -> np.ndarray:
    """float8_e4m3fn bytes (uint8, any shape) -> float32 values, exactly."""
    return E4M3_VALUES[codes]


def block_size(hf_config: dict) -> tuple[int, int]:
    """(b0, b1) of an FP8 checkpoint's block scales; checks that the checkpoint's
    quantization_config (if any) is one the converter reads. Raises ValueError."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return DEFAULT_BLOCK
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method not in SUPPORTED_QUANT_METHODS:
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported "
                         f"(checkpoints may be published as: {', '.join(SUPPORTED_QUANT_METHODS)})")
    block = qc.get("weight_block_size") or DEFAULT_BLOCK
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(f"quantization_config.weight_block_size {block!r} is not two positive integers")
    return int(block[0]), int(block[1])


def apply_block_scales(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """weight (..., R, C) float32 times its block scales (..., ceil(R/b0), ceil(C/b1)), in place
    and returned. A scalar (or one-element) scale_inv scales the whole tensor."""
    if scale_inv.size == 1:
        weight *= np.float32(scale_inv.reshape(()))
        return weight
    b0, b1 = block
    rows, cols = weight.shape[-2:]
    grid = (-(-rows // b0), -(-cols // b1))
    if scale_inv.shape != weight.shape[:-2] + grid:
        raise ValueError(f"scale_inv has shape {list(scale_inv.shape)}, expected {list(weight.shape[:-2] + grid)} "
                         f"for blocks of {b0}x{b1}")
    scale_inv = scale_inv.astype(np.float32, copy=False)
    for i in range(grid[0]):  # one block row at a time: no weight-sized scale array
        scale_cols = np.repeat(scale_inv[..., i : i + 1, :], b1, axis=-1)[..., :cols]  # (..., 1, C)
        weight[..., i * b0 : (i + 1) * b0, :] *= scale_cols
    return weight
