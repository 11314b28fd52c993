"""Argument checks shared by the bindings: everything C needs to be true about a buffer
(dtype, shape, contiguity, byte size), checked in Python first so a bad argument raises
instead of crashing the process; and the address of a checked buffer."""

from __future__ import annotations

import ctypes

import numpy as np

from colibrid.native.errors import InvalidArgumentError


# --------------------------------------------------------------------------------------------
# Argument checking (everything C needs to be true, checked in Python first)
# --------------------------------------------------------------------------------------------

_INT64_MAX = 2**63 - 1


def _as_count(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < 0 or value > _INT64_MAX:
        raise InvalidArgumentError(f"{name} must be >= 0, got {value}")
    return value


def _f32_matrix(a, name: str, cols: int | None = None) -> np.ndarray:
    """``a`` as a C-contiguous float32 (R, C) array (copies only if it is not contiguous)."""
    if not isinstance(a, np.ndarray):
        raise InvalidArgumentError(f"{name} must be a numpy array, got {type(a).__name__}")
    if a.dtype != np.float32:
        raise InvalidArgumentError(f"{name} must be float32, got {a.dtype}")
    if a.ndim != 2:
        raise InvalidArgumentError(f"{name} must be 2-D (rows, cols), got shape {a.shape}")
    if cols is not None and a.shape[1] != cols:
        raise InvalidArgumentError(f"{name} must have {cols} columns, got shape {a.shape}")
    return np.ascontiguousarray(a)


def _byte_view(data, name: str) -> np.ndarray:
    """A flat uint8 view of ``data`` (ndarray, bytes, bytearray, memoryview, mmap) without
    copying; works on read-only buffers such as mmap.ACCESS_READ maps."""
    if isinstance(data, np.ndarray):
        if data.dtype.hasobject:
            raise InvalidArgumentError(f"{name} must hold raw numbers, not Python objects")
        if not data.flags.c_contiguous:
            raise InvalidArgumentError(f"{name} must be C-contiguous")
        return data.reshape(-1).view(np.uint8)
    try:
        return np.frombuffer(data, dtype=np.uint8)
    except (TypeError, ValueError, BufferError) as exc:
        raise InvalidArgumentError(f"{name} must be a contiguous buffer: {exc}") from None


_char_from_buffer, _addressof = ctypes.c_char.from_buffer, ctypes.addressof


def _ptr(a: np.ndarray) -> int:
    """The address of a contiguous array's first byte. ctypes.c_char.from_buffer is ~6x
    cheaper than ndarray.ctypes.data (a decode step asks ~60 times); it needs a writable,
    non-empty buffer, the others take the slow way."""
    if a.flags.writeable and a.size:
        try:
            return _addressof(_char_from_buffer(a))
        except (TypeError, ValueError, BufferError):
            pass
    return a.ctypes.data


def _f32_vector(a, name: str, n: int) -> np.ndarray:
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.shape != (n,) or not a.flags.c_contiguous:
        raise InvalidArgumentError(f"{name} must be a C-contiguous float32 ({n},) array")
    return a


def _f32_out(a, name: str, shape: tuple) -> None:
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or not a.flags.c_contiguous or not a.flags.writeable \
            or a.shape != shape:
        raise InvalidArgumentError(f"{name} must be a writable C-contiguous float32 array of shape {shape}")
