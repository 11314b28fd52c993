"""The element types of pack tensors (col_type): names, block sizes, row bytes."""

from __future__ import annotations

import enum

import numpy as np

from colibrid.native.arguments import _as_count, _byte_view
from colibrid.native.errors import InvalidArgumentError
from colibrid.native.library import _lib


# --------------------------------------------------------------------------------------------
# Element types
# --------------------------------------------------------------------------------------------


class TensorType(enum.IntEnum):
    """Element types of pack tensors; values are the C col_type codes."""

    F32 = 0
    F16 = 1
    BF16 = 2
    Q8_0 = 3
    Q4_G64 = 4
    MXFP4 = 5

    @property
    def name_in_pack(self) -> str:
        """The name used in pack manifests and on the command line: "q4_g64"."""
        return self.name.lower()

    @classmethod
    def from_name(cls, name: str) -> "TensorType":
        """The type called ``name`` in a pack ("f32", "f16", "bf16", "q8_0", "q4_g64", "mxfp4")."""
        for member in cls:
            if member.name_in_pack == name:
                return member
        names = ", ".join(m.name_in_pack for m in cls)
        raise InvalidArgumentError(f"unknown tensor type {name!r}; types: {names}")

    @property
    def block_elems(self) -> int:
        """Values per quantization block (1 for f32/f16/bf16, 32 for q8_0 and mxfp4, 64 for q4_g64)."""
        return int(_lib().col_type_block_elems(int(self)))

    def row_bytes(self, n_cols: int) -> int:
        """Bytes of one row of ``n_cols`` values; n_cols must be a multiple of block_elems."""
        cached = _ROW_BYTES_CACHE.get((self, n_cols)) if type(n_cols) is int else None
        if cached is not None:  # hot path: every matmul asks for the same few widths
            return cached
        n = _as_count(n_cols, "n_cols")
        size = int(_lib().col_type_row_bytes(int(self), n))
        if size >= 0 and len(_ROW_BYTES_CACHE) < 4096:
            _ROW_BYTES_CACHE[(self, n)] = size
        if size < 0:
            raise InvalidArgumentError(
                f"{self.name_in_pack}: {n} columns is not a multiple of the block of {self.block_elems}"
            )
        return size


_ROW_BYTES_CACHE: dict[tuple[TensorType, int], int] = {}


def _as_type(type_: TensorType | int | str) -> TensorType:
    if isinstance(type_, TensorType):
        return type_
    if isinstance(type_, str):
        return TensorType.from_name(type_)
    try:
        return TensorType(int(type_))
    except (ValueError, TypeError):
        raise InvalidArgumentError(f"unknown tensor type {type_!r}") from None


def _matrix_bytes(data, name: str, t: TensorType, rows: int, cols: int) -> np.ndarray:
    """``data`` as the bytes of a (rows, cols) matrix encoded as ``t``, its size checked: the
    one size check of every binding that takes an encoded matrix. A C-contiguous ndarray is
    used as it is (the hot path: matmul runs for every projection of every token), any other
    buffer as a flat uint8 view."""
    if type(data) is np.ndarray and data.flags.c_contiguous and not data.dtype.hasobject:
        raw = data
    else:
        raw = _byte_view(data, name)
    need = rows * t.row_bytes(cols)
    if raw.nbytes != need:
        raise InvalidArgumentError(f"{name} has {raw.nbytes} bytes, {t.name_in_pack} ({rows}, {cols}) needs {need}")
    return raw
