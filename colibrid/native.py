"""The bridge to libcolibri: the only module that imports ctypes.

It loads the C library, declares every function's signature, turns non-zero status codes
into typed exceptions (``ColibriError`` and its subclasses), and offers numpy-friendly
wrappers that check dtypes, contiguity and shapes *before* calling C, so a bad argument
raises instead of crashing the process.

ctypes.CDLL releases the GIL for the duration of every call, so kernels run in parallel
with other Python threads.

Shape letters: R rows, C cols, T tokens, I n_in, O n_out.
"""

from __future__ import annotations

import ctypes
import enum
import importlib.machinery
import os
import threading
from pathlib import Path

import numpy as np

LIBRARY_ENV = "COLIBRI_LIBRARY"  # path of a libcolibri build to load instead of the packaged one

# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


class ColibriError(Exception):
    """A libcolibri call failed; ``status`` is the C status code (see colibri.h)."""

    status = -1

    def __init__(self, message: str | None = None, status: int | None = None):
        if status is not None:
            self.status = status
        super().__init__(message or f"libcolibri: status {self.status}")


class InvalidArgumentError(ColibriError, ValueError):
    """COL_EINVAL: bad type, size, shape or buffer; nothing was written."""

    status = 1


class OutOfMemoryError(ColibriError, MemoryError):
    """COL_ENOMEM: an allocation inside libcolibri failed; nothing was written."""

    status = 2


class ValueRangeError(ColibriError, ValueError):
    """COL_ERANGE: a value cannot be represented (NaN/inf or too large for a quantized type)."""

    status = 3


class NotSupportedError(ColibriError):
    """COL_ENOTSUP: not supported for this type or on this machine."""

    status = 4


class LibraryNotFoundError(ColibriError, ImportError):
    """libcolibri is not built (or COLIBRI_LIBRARY points at nothing usable)."""


_ERROR_BY_STATUS = {cls.status: cls for cls in (InvalidArgumentError, OutOfMemoryError, ValueRangeError, NotSupportedError)}


def check(status: int, what: str = "libcolibri") -> None:
    """Raises the ColibriError subclass for a non-zero status; returns None for COL_OK (0)."""
    if status == 0:
        return
    cls = _ERROR_BY_STATUS.get(status, ColibriError)
    reason = _lib().col_status_string(status).decode()
    raise cls(f"{what}: {reason} (status {status})", status)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

_c_float_p = ctypes.POINTER(ctypes.c_float)
_c_int32_p = ctypes.POINTER(ctypes.c_int32)

# name -> (restype, argtypes); every exported function of colibri.h
_SIGNATURES = {
    "col_status_string": (ctypes.c_char_p, [ctypes.c_int]),
    "col_version": (ctypes.c_char_p, []),
    "col_type_block_elems": (ctypes.c_int64, [ctypes.c_int]),
    "col_type_row_bytes": (ctypes.c_int64, [ctypes.c_int, ctypes.c_int64]),
    # (type, src (R, C) f32, rows, cols, dst (R, row_bytes))
    "col_quantize": (ctypes.c_int, [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]),
    # (type, src (R, row_bytes), rows, cols, dst (R, C) f32)
    "col_dequantize": (ctypes.c_int, [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]),
    # (type, w (n_rows, row_bytes), cols, ids (N) i32, n_ids, out (N, C) f32)
    "col_get_rows": (ctypes.c_int, [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]),
    # (type, w (O, row_bytes), n_out, n_in, x (T, I) f32, n_tok, y (T, O) f32)
    "col_matmul": (ctypes.c_int, [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]),
    "col_crc32c": (ctypes.c_uint32, [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]),
    "col_crc32c_sw": (ctypes.c_uint32, [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]),
    "col_crc32c_hw": (ctypes.c_int, []),
}

_lib_handle: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


def library_path() -> Path:
    """Where libcolibri is loaded from: $COLIBRI_LIBRARY, else the build inside this package."""
    override = os.environ.get(LIBRARY_ENV)
    if override:
        path = Path(override)
        if not path.is_file():
            raise LibraryNotFoundError(f"{LIBRARY_ENV}={override} is not a file")
        return path
    package_dir = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = package_dir / f"_libcolibri{suffix}"
        if path.is_file():
            return path
    found = sorted(package_dir.glob("_libcolibri*.so"))
    if found:
        return found[0]
    raise LibraryNotFoundError(
        f"libcolibri is not built (no _libcolibri*.so in {package_dir}): "
        f"run `pip install -e .` in the colibri source tree, or set {LIBRARY_ENV}=/path/to/libcolibri.so"
    )


def _load() -> ctypes.CDLL:
    path = library_path()
    try:
        lib = ctypes.CDLL(str(path))  # CDLL (not PyDLL): calls release the GIL
    except OSError as exc:
        raise LibraryNotFoundError(f"cannot load libcolibri from {path}: {exc}") from exc
    for name, (restype, argtypes) in _SIGNATURES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise LibraryNotFoundError(
                f"libcolibri at {path} has no {name}: the build is stale, run `pip install -e .` again"
            ) from None
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


def _lib() -> ctypes.CDLL:
    """The loaded library (loaded on first use, so importing this module never fails)."""
    global _lib_handle
    if _lib_handle is None:
        with _lib_lock:
            if _lib_handle is None:
                _lib_handle = _load()
    return _lib_handle


def version() -> str:
    """libcolibri's version string, e.g. "0.1.0"."""
    return _lib().col_version().decode()


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

    @property
    def name_in_pack(self) -> str:
        """The name used in pack manifests and on the command line: "q4_g64"."""
        return self.name.lower()

    @classmethod
    def from_name(cls, name: str) -> "TensorType":
        """The type called ``name`` in a pack ("f32", "f16", "bf16", "q8_0", "q4_g64")."""
        for member in cls:
            if member.name_in_pack == name:
                return member
        names = ", ".join(m.name_in_pack for m in cls)
        raise InvalidArgumentError(f"unknown tensor type {name!r}; types: {names}")

    @property
    def block_elems(self) -> int:
        """Values per quantization block (1 for f32/f16/bf16, 32 for q8_0, 64 for q4_g64)."""
        return int(_lib().col_type_block_elems(int(self)))

    def row_bytes(self, n_cols: int) -> int:
        """Bytes of one row of ``n_cols`` values; n_cols must be a multiple of block_elems."""
        n = _as_count(n_cols, "n_cols")
        size = int(_lib().col_type_row_bytes(int(self), n))
        if size < 0:
            raise InvalidArgumentError(
                f"{self.name_in_pack}: {n} columns is not a multiple of the block of {self.block_elems}"
            )
        return size


def _as_type(type_: TensorType | int | str) -> TensorType:
    if isinstance(type_, TensorType):
        return type_
    if isinstance(type_, str):
        return TensorType.from_name(type_)
    try:
        return TensorType(int(type_))
    except (ValueError, TypeError):
        raise InvalidArgumentError(f"unknown tensor type {type_!r}") from None


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


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


def quantize(type_: TensorType | int | str, src: np.ndarray) -> np.ndarray:
    """Encodes float32 ``src`` (R, C) as ``type_``; returns uint8 (R, row_bytes(C)).

    Raises ValueRangeError for NaN/inf (or |x| > ~65504) in a q8_0 / q4_g64 block."""
    t = _as_type(type_)
    src = _f32_matrix(src, "src")
    rows, cols = src.shape
    dst = np.empty((rows, t.row_bytes(cols)), dtype=np.uint8)
    check(_lib().col_quantize(int(t), _ptr(src), rows, cols, _ptr(dst)), f"quantize {t.name_in_pack}")
    return dst


def dequantize(type_: TensorType | int | str, data, rows: int, cols: int) -> np.ndarray:
    """Decodes ``data`` (exactly R * row_bytes(C) bytes, any buffer) to float32 (R, C)."""
    t = _as_type(type_)
    rows, cols = _as_count(rows, "rows"), _as_count(cols, "cols")
    raw = _byte_view(data, "data")
    need = rows * t.row_bytes(cols)
    if raw.size != need:
        raise InvalidArgumentError(f"data has {raw.size} bytes, {t.name_in_pack} ({rows}, {cols}) needs {need}")
    out = np.empty((rows, cols), dtype=np.float32)
    check(_lib().col_dequantize(int(t), _ptr(raw), rows, cols, _ptr(out)), f"dequantize {t.name_in_pack}")
    return out


def get_rows(type_: TensorType | int | str, data, cols: int, ids) -> np.ndarray:
    """Embedding lookup: decodes rows ``ids`` (N) of ``data`` (n_rows, row_bytes(C)) to
    float32 (N, C). n_rows is len(data) / row_bytes; every id must be in [0, n_rows)."""
    t = _as_type(type_)
    cols = _as_count(cols, "cols")
    raw = _byte_view(data, "data")
    row_bytes = t.row_bytes(cols)
    if row_bytes == 0:
        n_rows = 0
    elif raw.size % row_bytes != 0:
        raise InvalidArgumentError(f"data has {raw.size} bytes, not a whole number of {row_bytes}-byte rows")
    else:
        n_rows = raw.size // row_bytes
    ids_arr = np.asarray(ids)
    if ids_arr.ndim != 1 or not (ids_arr.size == 0 or np.issubdtype(ids_arr.dtype, np.integer)):
        raise InvalidArgumentError(f"ids must be a 1-D integer array, got {ids_arr.dtype} {ids_arr.shape}")
    if ids_arr.size and (int(ids_arr.min()) < 0 or int(ids_arr.max()) >= n_rows):
        raise InvalidArgumentError(f"ids must be in [0, {n_rows}), got [{ids_arr.min()}, {ids_arr.max()}]")
    ids32 = np.ascontiguousarray(ids_arr, dtype=np.int32)
    out = np.empty((ids32.size, cols), dtype=np.float32)
    check(_lib().col_get_rows(int(t), _ptr(raw), cols, _ptr(ids32), ids32.size, _ptr(out)), f"get_rows {t.name_in_pack}")
    return out


def matmul(type_: TensorType | int | str, data, n_out: int, n_in: int, x: np.ndarray) -> np.ndarray:
    """y = x @ w.T: ``data`` is the weight w (O, I) encoded as ``type_`` (exactly
    O * row_bytes(I) bytes), ``x`` float32 (T, I); returns float32 (T, O)."""
    t = _as_type(type_)
    n_out, n_in = _as_count(n_out, "n_out"), _as_count(n_in, "n_in")
    raw = _byte_view(data, "data")
    need = n_out * t.row_bytes(n_in)
    if raw.size != need:
        raise InvalidArgumentError(f"data has {raw.size} bytes, {t.name_in_pack} ({n_out}, {n_in}) needs {need}")
    x = _f32_matrix(x, "x", cols=n_in)
    n_tok = x.shape[0]
    y = np.empty((n_tok, n_out), dtype=np.float32)
    check(_lib().col_matmul(int(t), _ptr(raw), n_out, n_in, _ptr(x), n_tok, _ptr(y)), f"matmul {t.name_in_pack}")
    return y


# --------------------------------------------------------------------------------------------
# CRC-32C
# --------------------------------------------------------------------------------------------


def _crc_args(buffer, crc) -> tuple[int, np.ndarray]:
    if isinstance(crc, bool) or not isinstance(crc, (int, np.integer)) or not 0 <= int(crc) <= 0xFFFFFFFF:
        raise InvalidArgumentError(f"crc must be an int in [0, 2**32), got {crc!r}")
    return int(crc), _byte_view(buffer, "buffer")


def crc32c(buffer, crc: int = 0) -> int:
    """CRC-32C of ``buffer`` (bytes, bytearray, memoryview, mmap or contiguous ndarray, read
    without copying); pass a previous result as ``crc`` to continue it."""
    crc, raw = _crc_args(buffer, crc)
    return int(_lib().col_crc32c(crc, _ptr(raw), raw.size))


def crc32c_software(buffer, crc: int = 0) -> int:
    """Same as crc32c() but always on the table-driven path (for tests and comparisons)."""
    crc, raw = _crc_args(buffer, crc)
    return int(_lib().col_crc32c_sw(crc, _ptr(raw), raw.size))


def crc32c_uses_hardware() -> bool:
    """True if crc32c() runs on the SSE4.2 crc32 instruction on this machine."""
    return bool(_lib().col_crc32c_hw())
