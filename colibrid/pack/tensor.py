"""A weight matrix as stored in a pack: its element type, logical shape and raw bytes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibrid.native import TensorType


@dataclass(frozen=True)
class PackedTensor:
    """``data`` is float32 (rows, cols) for f32 tensors, else uint8 (rows, row_bytes).

    1-D tensors (norms, biases) are always f32 with shape (n,).
    """

    type: TensorType
    shape: tuple[int, ...]
    data: np.ndarray

    @classmethod
    def from_bytes(cls, type_: TensorType, shape: tuple[int, ...], raw: np.ndarray) -> "PackedTensor":
        """View ``raw`` (uint8, exactly the tensor's bytes) as a tensor without copying."""
        if type_ is TensorType.F32:
            return cls(type_, shape, raw.view(np.float32).reshape(shape))
        rows, cols = shape
        return cls(type_, shape, raw.reshape(rows, type_.row_bytes(cols)))

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)
