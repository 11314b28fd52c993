"""The small numeric building blocks shared by every architecture."""

from __future__ import annotations

import numpy as np

from colibrid import native
from colibrid.pack.tensor import PackedTensor


def linear(x: np.ndarray, weight: PackedTensor, bias: PackedTensor | None = None) -> np.ndarray:
    """x (T, in) @ weight(out, in)^T (+ bias) -> (T, out), float32.

    Every type goes through libcolibri, which reads the packed bytes directly (no
    dequantized copy of the weight) and computes each token's row on its own: a token's
    result does not depend on the other tokens of the batch (unlike a BLAS gemm), so decode
    with a KV cache gives the same numbers as a full forward.
    """
    out_features, in_features = weight.shape
    y = native.matmul(weight.type, weight.data, out_features, in_features, np.ascontiguousarray(x, dtype=np.float32))
    if bias is not None:
        y = y + bias.data
    return y.astype(np.float32, copy=False)


def rms_norm(x: np.ndarray, weight: PackedTensor, eps: float) -> np.ndarray:
    """RMSNorm over the last axis, in float32 like the reference (libcolibri)."""
    return native.rms_norm(np.asarray(x, dtype=np.float32), weight.data, eps)


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp(-x) -> inf for x < -88 gives the right limit, -0
        return x / (np.float32(1.0) + np.exp(-x))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    shifted = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(shifted)
    return e / np.sum(e, axis=axis, keepdims=True)


def swiglu_mlp(x: np.ndarray, gate: PackedTensor, up: PackedTensor, down: PackedTensor) -> np.ndarray:
    """down(silu(gate(x)) * up(x)): the feed-forward shape of every expert and dense MLP."""
    return linear(silu(linear(x, gate)) * linear(x, up), down)
