"""The small numeric building blocks shared by every architecture."""

from __future__ import annotations

import numpy as np

from colibrid import native
from colibrid.pack.tensor import PackedTensor


def linear(x: np.ndarray, weight: PackedTensor, bias: PackedTensor | None = None) -> np.ndarray:
    """x (T, in) @ weight(out, in)^T (+ bias) -> (T, out), float32.

    f32 weights use numpy's BLAS; every other type goes through libcolibri, which
    reads the packed bytes directly (no dequantized copy of the weight).
    """
    if weight.type is native.TensorType.F32:
        y = x @ weight.data.T
    else:
        out_features, in_features = weight.shape
        y = native.matmul(weight.type, weight.data, out_features, in_features, np.ascontiguousarray(x, dtype=np.float32))
    if bias is not None:
        y = y + bias.data
    return y.astype(np.float32, copy=False)


def rms_norm(x: np.ndarray, weight: PackedTensor, eps: float) -> np.ndarray:
    """RMSNorm over the last axis, in float32 like the reference."""
    variance = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True)
    return (weight.data * (x / np.sqrt(variance + np.float32(eps)))).astype(np.float32, copy=False)


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
