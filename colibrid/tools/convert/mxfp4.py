"""Published MXFP4 tensors (gpt-oss) -> the pack's mxfp4 rows, losslessly.

A checkpoint stores an MXFP4 weight W (..., R, C) as two U8 tensors:
  ``<name>_blocks`` (..., R, C/32, 16): e2m1 codes, two per byte, element 2k of a group of 32
                    in the LOW nibble of byte k and element 2k + 1 in the HIGH nibble;
  ``<name>_scales`` (..., R, C/32): e8m0 exponents, scale 2^(s - 127) per group of 32.
(transformers' integrations/mxfp4.py decodes exactly this.) The pack's mxfp4 block
(docs/format.md) keeps the exponent byte and every code, only moving the codes so that
element j and element j + 16 share a byte: each SIMD kernel then expands one byte vector
into the block's 32 weights in element order. Nothing is rounded: the pack decodes to the
same float32 values as the published tensor.
"""

from __future__ import annotations

import numpy as np

GROUP = 32  # values per e8m0 exponent
BLOCK_BYTES = 17  # the pack's block: exponent byte, 16 code bytes


def pack_rows(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks (..., G, 16) uint8 and scales (..., G) uint8 -> (..., G * 17) uint8 rows of the
    pack's mxfp4 type."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1:] != (GROUP // 2,) or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)} "
                         f"(blocks must be scales' shape plus a last axis of {GROUP // 2})")
    codes = np.empty(blocks.shape[:-1] + (GROUP,), dtype=np.uint8)  # (..., G, 32) in element order
    codes[..., 0::2] = blocks & 0x0F
    codes[..., 1::2] = blocks >> 4
    out = np.empty(blocks.shape[:-1] + (BLOCK_BYTES,), dtype=np.uint8)  # (..., G, 17)
    out[..., 0] = scales
    out[..., 1:] = codes[..., : GROUP // 2] | (codes[..., GROUP // 2 :] << 4)
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK_BYTES)
