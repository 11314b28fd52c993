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
    # (pool, type, w (O, row_bytes), n_out, n_in, x (T, I) f32, n_tok, y (T, O) f32)
    "col_matmul": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]),
    "col_source_matrix_size": (ctypes.c_size_t, []),
    # (pool, src, rows, cols, type, dst (R, row_bytes))
    "col_convert": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]),
    "col_kernels_get": (ctypes.c_int, []),
    "col_kernels_supported": (ctypes.c_int, [ctypes.c_int]),
    "col_kernels_set": (ctypes.c_int, [ctypes.c_int]),
    "col_kernels_name": (ctypes.c_char_p, [ctypes.c_int]),
    "col_pool_params_size": (ctypes.c_size_t, []),
    "col_pool_create": (ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]),
    "col_pool_destroy": (None, [ctypes.c_void_p]),
    "col_pool_n_threads": (ctypes.c_int, [ctypes.c_void_p]),
    "col_pool_worker_cpu": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int]),
    # (pool, type, n_experts, gate (E) ptrs, up (E) ptrs, down (E) ptrs, D, F, x (T, D) f32, n_tok,
    #  expert_of (T, A) i32, weight (T, A) f32, n_slots, out (T, D) f32)
    "col_moe_experts": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_int64, ctypes.c_void_p]),
    "col_expert_ffn_size": (ctypes.c_size_t, []),
    # (pool, ffn_kind, type, n_experts, gate, up, down, D, F, x, n_tok, expert_of, weight, n_slots, out): as col_moe_experts
    "col_moe_experts_ffn": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                           ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]),
    # (x (R, N) f32, weight (N) f32, rows, n, eps, y (R, N) f32)
    "col_rms_norm": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p]),
    # (x (T, H, Hd) f32 in place, n_tok, n_heads, head_dim, cos (T, Hd), sin (T, Hd))
    "col_rope": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]),
    # (x (T, H, Hd) f32 in place, n_tok, n_heads, head_dim, rotary_dim, cos (T, Hr), sin (T, Hr))
    "col_rope_partial": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_void_p, ctypes.c_void_p]),
    # (pool, q (Tq, H, Hd), keys (S, K, Hd), vals (S, K, Hd), n_q, n_keys, H, K, Hd, positions (Tq) i64,
    #  window, chunk, ring, scale, out (Tq, H*Hd))
    "col_attention": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.c_int64, ctypes.c_float, ctypes.c_void_p]),
    # (g (n) f32, u (n) f32, h (n) f32 out, n)
    "col_silu_mul": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]),
    # (g (n) f32, u (n) f32, h (n) f32 out, n)
    "col_gelu_tanh_mul": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]),
    "col_attention_layer_size": (ctypes.c_size_t, []),
    # (pool, layer, x (T, D) f32 in place, n_tok, cos (T, Hd), sin (T, Hd), keys (>= S or ring_rows, K, Hd), vals, n_past,
    #  ring_rows (0: a flat cache))
    "col_attention_block": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]),
    # (pool, type, router (E, row_bytes(D)), E, D, x (T, D) f32, n_tok, top_k, normalize, experts (T, A) i32, weights (T, A) f32)
    "col_moe_route": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                     ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]),
    "col_mla_layer_size": (ctypes.c_size_t, []),
    # (pool, layer, x (T, D) f32 in place, n_tok, cos (T, R), sin (T, R), cache (>= S, C + R) f32, n_past)
    "col_mla_block": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]),
    "col_deltanet_layer_size": (ctypes.c_size_t, []),
    # (pool, layer, x (T, D) f32 in place, n_tok, conv_state (Kc - 1, C) f32, recurrent_state (Hv, Dk, Dv) f32)
    "col_deltanet_block": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                          ctypes.c_void_p]),
    "col_moe_router_size": (ctypes.c_size_t, []),
    # (pool, router, x (T, D) f32, n_tok, experts (T, A) i32, weights (T, A) f32)
    "col_moe_router_route": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                            ctypes.c_void_p]),
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
    package_dir = Path(__file__).resolve().parent.parent  # colibrid/, where build_ext puts it
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
    _check_struct_sizes(lib)
    _apply_kernels_env(lib)
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


def _matrix_bytes(data, name: str, t: TensorType, rows: int, cols: int) -> np.ndarray:
    """``data`` as the flat bytes of a (rows, cols) matrix encoded as ``t``, its size checked."""
    raw = _byte_view(data, name)
    if raw.nbytes != rows * t.row_bytes(cols):
        raise InvalidArgumentError(f"{name} has {raw.nbytes} bytes, {t.name_in_pack} ({rows}, {cols}) needs "
                                   f"{rows * t.row_bytes(cols)}")
    return raw


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


# --------------------------------------------------------------------------------------------
# Kernel levels (runtime CPU dispatch)
# --------------------------------------------------------------------------------------------

KERNELS_ENV = "COLIBRI_KERNELS"  # force a kernel level at load, e.g. COLIBRI_KERNELS=portable
KERNEL_LEVELS = ("portable", "avx2", "avx512", "avx512_vnni", "neon")  # index = C enum col_kernels


def _apply_kernels_env(lib: ctypes.CDLL) -> None:
    wanted = os.environ.get(KERNELS_ENV)
    if not wanted:
        return
    if wanted not in KERNEL_LEVELS:
        raise InvalidArgumentError(f"{KERNELS_ENV}={wanted!r}: levels are {', '.join(KERNEL_LEVELS)}")
    status = lib.col_kernels_set(KERNEL_LEVELS.index(wanted))
    if status != 0:
        raise NotSupportedError(f"{KERNELS_ENV}={wanted}: this CPU cannot run it", status)


def kernels() -> str:
    """The active kernel level: "portable", "avx2", "avx512", "avx512_vnni" or "neon"."""
    return _lib().col_kernels_name(_lib().col_kernels_get()).decode()


def supported_kernels() -> list[str]:
    """Every level this CPU can run, "portable" first."""
    return [name for i, name in enumerate(KERNEL_LEVELS) if _lib().col_kernels_supported(i)]


def set_kernels(level: str) -> None:
    """Makes ``level`` active for the whole process (tests and benchmarks: "portable" is the
    reference). Raises NotSupportedError if the CPU cannot run it."""
    if level not in KERNEL_LEVELS:
        raise InvalidArgumentError(f"unknown kernel level {level!r}; levels: {', '.join(KERNEL_LEVELS)}")
    check(_lib().col_kernels_set(KERNEL_LEVELS.index(level)), f"set kernels {level}")


# --------------------------------------------------------------------------------------------
# Worker pool
# --------------------------------------------------------------------------------------------


class _PoolParams(ctypes.Structure):
    """Mirror of col_pool_params (colibri.h); its size is checked against C at load."""

    _fields_ = [
        ("n_threads", ctypes.c_int32),
        ("n_cpus", ctypes.c_int32),
        ("cpus", ctypes.POINTER(ctypes.c_int32)),
        ("spin_us", ctypes.c_int32),
    ]


def _check_struct_sizes(lib: ctypes.CDLL) -> None:
    for struct, size_fn in ((_PoolParams, lib.col_pool_params_size), (AttentionLayer, lib.col_attention_layer_size),
                            (MoeRouter, lib.col_moe_router_size), (MlaLayer, lib.col_mla_layer_size),
                            (ExpertFfn, lib.col_expert_ffn_size),
                            (DeltaNetLayer, lib.col_deltanet_layer_size),
                            (_SourceMatrix, lib.col_source_matrix_size)):
        if ctypes.sizeof(struct) != size_fn():
            raise LibraryNotFoundError(
                f"{struct.__name__} is {ctypes.sizeof(struct)} bytes, libcolibri says {size_fn()}: the build is stale"
            )


class ThreadPool:
    """libcolibri's worker pool: n_threads - 1 pinned workers plus the calling thread.

    ``cpus``: the CPU ids to pin to (default: every CPU this process may use);
    ``n_threads``: default one per CPU in ``cpus``. Created once, reused by every call;
    ``close()`` (or the context manager) joins the workers."""

    def __init__(self, n_threads: int | None = None, cpus=None, spin_us: int | None = None) -> None:
        cpu_list = [int(c) for c in cpus] if cpus is not None else []
        cpu_array = (ctypes.c_int32 * max(len(cpu_list), 1))(*cpu_list)
        params = _PoolParams(_as_count(n_threads or 0, "n_threads"), len(cpu_list),
                             ctypes.cast(cpu_array, ctypes.POINTER(ctypes.c_int32)), -1 if spin_us is None else int(spin_us))
        handle = ctypes.c_void_p()
        check(_lib().col_pool_create(ctypes.byref(params), ctypes.byref(handle)), "pool create")
        self._handle: int | None = handle.value

    @property
    def handle(self) -> int:
        if self._handle is None:
            raise InvalidArgumentError("the pool is closed")
        return self._handle

    @property
    def n_threads(self) -> int:
        return int(_lib().col_pool_n_threads(self.handle))

    @property
    def worker_cpus(self) -> list[int]:
        """The CPU each worker (1..n_threads-1) is pinned to."""
        return [int(_lib().col_pool_worker_cpu(self.handle, i)) for i in range(1, self.n_threads)]

    def close(self) -> None:
        if self._handle is not None:
            _lib().col_pool_destroy(self._handle)
            self._handle = None

    def __enter__(self) -> "ThreadPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


_default_pool: ThreadPool | None = None


def default_pool() -> ThreadPool:
    """The process-wide pool every compute call uses unless given one (created on first use
    with one thread per allowed CPU; replace it with configure_default_pool)."""
    global _default_pool
    if _default_pool is None:
        _lib()  # loads the library first: _lib takes the same (non-reentrant) lock
        with _lib_lock:
            if _default_pool is None:
                _default_pool = ThreadPool()
    return _default_pool


def configure_default_pool(n_threads: int | None = None, cpus=None, spin_us: int | None = None) -> ThreadPool:
    """Replaces the default pool (e.g. with the daemon's cpu_affinity). Not while computing."""
    global _default_pool
    new = ThreadPool(n_threads, cpus, spin_us)
    old, _default_pool = _default_pool, new
    if old is not None:
        old.close()
    return new


def _pool_handle(pool: ThreadPool | None) -> int:
    return (pool or default_pool()).handle


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


def quantize(type_: TensorType | int | str, src: np.ndarray) -> np.ndarray:
    """Encodes float32 ``src`` (R, C) as ``type_``; returns uint8 (R, row_bytes(C)).

    Raises ValueRangeError for NaN/inf in a q8_0 / q4_g64 / mxfp4 block (or |x| > ~65504 in a
    q8_0 / q4_g64 one)."""
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
    raw = _matrix_bytes(data, "data", t, rows, cols)
    out = np.empty((rows, cols), dtype=np.float32)
    check(_lib().col_dequantize(int(t), _ptr(raw), rows, cols, _ptr(out)), f"dequantize {t.name_in_pack}")
    return out


# source dtypes of col_convert, by safetensors name (index = C enum col_source_dtype)
SOURCE_DTYPES = ("F32", "F16", "BF16", "F8_E4M3")
_SOURCE_NUMPY = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F8_E4M3": np.uint8}


class _SourceMatrix(ctypes.Structure):
    """Mirror of col_source_matrix (colibri.h); its size is checked against C at load."""

    _fields_ = [
        ("dtype", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("data", ctypes.c_void_p),
        ("n_src_rows", ctypes.c_int64),
        ("row0", ctypes.c_int64),
        ("row_step", ctypes.c_int64),
        ("scale_inv", ctypes.c_void_p),
        ("block_rows", ctypes.c_int64),
        ("block_cols", ctypes.c_int64),
    ]


def convert(type_: TensorType | int | str, source: np.ndarray, dtype: str, rows: slice | None = None,
            scale_inv: np.ndarray | None = None, block: tuple[int, int] | None = None,
            pool: "ThreadPool | None" = None) -> np.ndarray:
    """Checkpoint rows -> ``type_``, on ``pool`` (default: default_pool()); returns uint8
    (R, row_bytes(C)), the same bytes as ``quantize(type_, <source as float32>[rows])``.

    ``source``: the published (N, C) elements of safetensors ``dtype`` (F32, F16, BF16 as
    uint16 bits, F8_E4M3 as uint8 codes), C-contiguous (a read-only memory map is fine);
    ``rows``: a slice of the N rows (default all); ``scale_inv``: F8_E4M3 only, float32
    (ceil(N / b0), ceil(C / b1)) factors for blocks ``block`` = (b0, b1)."""
    t = _as_type(type_)
    if dtype not in SOURCE_DTYPES:
        raise InvalidArgumentError(f"source dtype {dtype!r}: col_convert reads {', '.join(SOURCE_DTYPES)}")
    if not isinstance(source, np.ndarray) or source.ndim != 2 or source.dtype != _SOURCE_NUMPY[dtype] \
            or not source.flags.c_contiguous:
        raise InvalidArgumentError(f"source must be a C-contiguous 2-D {np.dtype(_SOURCE_NUMPY[dtype]).name} array for {dtype}")
    n_src_rows, cols = source.shape
    row0, _, row_step = (rows or slice(None)).indices(n_src_rows)
    if row_step < 1:
        raise InvalidArgumentError(f"rows {rows}: the step must be positive")
    n_rows = len(range(*(rows or slice(None)).indices(n_src_rows)))
    matrix = _SourceMatrix(SOURCE_DTYPES.index(dtype), 0, _ptr(source) if source.size else None, n_src_rows, row0, row_step)
    if scale_inv is not None:
        if dtype != "F8_E4M3" or block is None:
            raise InvalidArgumentError("scale_inv goes with F8_E4M3 sources and a block size")
        b0, b1 = block
        grid = (-(-n_src_rows // b0), -(-cols // b1))
        scale_inv = np.ascontiguousarray(scale_inv, dtype=np.float32)
        if scale_inv.shape != grid:
            raise InvalidArgumentError(f"scale_inv has shape {list(scale_inv.shape)}, expected {list(grid)} for blocks of {b0}x{b1}")
        matrix.scale_inv, matrix.block_rows, matrix.block_cols = _ptr(scale_inv), b0, b1
    dst = np.empty((n_rows, t.row_bytes(cols)), dtype=np.uint8)
    check(_lib().col_convert(_pool_handle(pool), ctypes.byref(matrix), n_rows, cols, int(t), _ptr(dst)),
          f"convert {dtype} to {t.name_in_pack}")
    return dst


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


def matmul(type_: TensorType | int | str, data, n_out: int, n_in: int, x: np.ndarray,
           pool: "ThreadPool | None" = None) -> np.ndarray:
    """y = x @ w.T: ``data`` is the weight w (O, I) encoded as ``type_`` (exactly
    O * row_bytes(I) bytes), ``x`` float32 (T, I); returns float32 (T, O). Rows are split
    across ``pool`` (default: default_pool())."""
    t = _as_type(type_)
    n_out, n_in = _as_count(n_out, "n_out"), _as_count(n_in, "n_in")
    # hot path (every projection of every token): a contiguous ndarray is used as it is
    if type(data) is np.ndarray and data.flags.c_contiguous and not data.dtype.hasobject:
        raw = data
    else:
        raw = _byte_view(data, "data")
    need = n_out * t.row_bytes(n_in)
    if raw.nbytes != need:
        raise InvalidArgumentError(f"data has {raw.nbytes} bytes, {t.name_in_pack} ({n_out}, {n_in}) needs {need}")
    x = _f32_matrix(x, "x", cols=n_in)
    n_tok = x.shape[0]
    y = np.empty((n_tok, n_out), dtype=np.float32)
    status = _lib().col_matmul(_pool_handle(pool), int(t), _ptr(raw), n_out, n_in, _ptr(x), n_tok, _ptr(y))
    if status:  # the message only on failure: building it costs as much as the checks above
        check(status, f"matmul {t.name_in_pack}")
    return y


class ExpertBuffers:
    """One routed expert's three matrices for col_moe_experts (and, for experts with biases,
    their float32 bias vectors: gate and up (F), down (D)): checked once (type, sizes,
    contiguity) and reduced to addresses, so a layer step that reuses the same expert views
    (resident experts, cache slots) pays no per-call checks. Keeps the buffers alive."""

    __slots__ = ("type", "dim", "ffn", "gate", "up", "down", "gate_bias", "up_bias", "down_bias", "_keep")

    def __init__(self, type_: TensorType | int | str, gate, up, down, dim: int, ffn: int,
                 biases: "tuple[np.ndarray, np.ndarray, np.ndarray] | None" = None) -> None:
        t = _as_type(type_)
        self.type, self.dim, self.ffn = t, _as_count(dim, "dim"), _as_count(ffn, "ffn")
        keep = []
        for field, data, rows, cols in (("gate", gate, self.ffn, self.dim), ("up", up, self.ffn, self.dim),
                                        ("down", down, self.dim, self.ffn)):
            raw = _matrix_bytes(data, f"expert {field}", t, rows, cols)
            keep.append(raw)
            setattr(self, field, _ptr(raw))
        self.gate_bias = self.up_bias = self.down_bias = None
        if biases is not None:
            for field, vector, n in zip(("gate_bias", "up_bias", "down_bias"), biases, (self.ffn, self.ffn, self.dim)):
                keep.append(_f32_vector(vector, f"expert {field}", n))
                setattr(self, field, _ptr(vector))
        self._keep = keep


EXPERT_ACTIVATION_CODES = {"swiglu": 0, "clamped_swiglu": 1, "geglu_tanh": 2}  # enum col_expert_activation


class ExpertFfn(ctypes.Structure):
    """Mirror of col_expert_ffn (colibri.h); its size is checked against C at load."""

    _fields_ = [("activation", ctypes.c_int32), ("alpha", ctypes.c_float), ("limit", ctypes.c_float),
                ("reserved", ctypes.c_int32), ("gate_bias", ctypes.c_void_p), ("up_bias", ctypes.c_void_p),
                ("down_bias", ctypes.c_void_p), ("weight_on_input", ctypes.c_int32), ("reserved2", ctypes.c_int32)]


def moe_experts(type_: TensorType | int | str, gates, ups, downs, dim: int, ffn: int, x: np.ndarray,
                expert_of: np.ndarray, weight: np.ndarray, out: np.ndarray, pool: "ThreadPool | None" = None,
                biases=None, activation: str = "swiglu", alpha: float = 1.0, limit: float = 0.0,
                weight_on_input: bool = False) -> None:
    """One fused MoE layer step, accumulated into ``out`` (T, D) float32 in place:
    for every (t, a) with e = expert_of[t, a] >= 0,
    out[t] += weight[t, a] * down_e(silu(gate_e x[t]) * up_e x[t]).

    ``gates``/``ups`` are E buffers of (F, row_bytes(D)) bytes, ``downs`` E buffers of
    (D, row_bytes(F)) bytes (any buffer: numpy views of a record, slot memory);
    ``expert_of`` (T, A) integers in [-1, E), ``weight`` (T, A) float32. Experts are added in
    increasing index. The buffers are only read during the call."""
    if len(ups) != len(gates) or len(downs) != len(gates):
        raise InvalidArgumentError(f"gates, ups and downs must have the same length, got {len(gates)}, {len(ups)}, {len(downs)}")
    biases = biases if biases is not None else [None] * len(gates)
    experts = [ExpertBuffers(type_, g, u, d, dim, ffn, b) for g, u, d, b in zip(gates, ups, downs, biases)]
    moe_experts_of(experts, x, expert_of, weight, out, pool, type_=type_, dim=dim, ffn=ffn, activation=activation,
                   alpha=alpha, limit=limit, weight_on_input=weight_on_input)


def moe_experts_of(experts: "list[ExpertBuffers]", x: np.ndarray, expert_of: np.ndarray, weight: np.ndarray,
                   out: np.ndarray, pool: "ThreadPool | None" = None, type_=None, dim: int | None = None,
                   ffn: int | None = None, activation: str = "swiglu", alpha: float = 1.0, limit: float = 0.0,
                   weight_on_input: bool = False) -> None:
    """moe_experts over prepared ExpertBuffers (all of one type and shape; ``type_``, ``dim``
    and ``ffn`` are needed only when ``experts`` is empty). ``activation`` "clamped_swiglu"
    (with ``alpha`` and ``limit``), experts carrying biases and ``weight_on_input`` (the
    weight scales each expert's input, its output is added unweighted: Llama 4) run
    col_moe_experts_ffn."""
    if experts:
        first = experts[0]
        t, dim, ffn = first.type, first.dim, first.ffn
        if any(e.type is not t or e.dim != dim or e.ffn != ffn for e in experts):
            raise InvalidArgumentError("experts must all have the same type and shape")
    else:
        t, dim, ffn = _as_type(type_), _as_count(dim, "dim"), _as_count(ffn, "ffn")
    n_experts = len(experts)
    x = _f32_matrix(x, "x", cols=dim)
    n_tok = x.shape[0]
    if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != (n_tok, dim) or not out.flags.c_contiguous \
            or not out.flags.writeable:
        raise InvalidArgumentError(f"out must be a writable C-contiguous float32 ({n_tok}, {dim}) array")
    expert_of = np.ascontiguousarray(expert_of, dtype=np.int32)
    weight = np.ascontiguousarray(weight, dtype=np.float32)
    if expert_of.ndim != 2 or expert_of.shape[0] != n_tok or weight.shape != expert_of.shape:
        raise InvalidArgumentError(f"expert_of and weight must both be ({n_tok}, A), got {expert_of.shape} and {weight.shape}")
    # entries outside [-1, E) are refused by libcolibri before it writes anything (COL_EINVAL)
    ptrs = (ctypes.c_void_p * (3 * max(n_experts, 1)))()
    ptrs[:3 * n_experts] = [e.gate for e in experts] + [e.up for e in experts] + [e.down for e in experts]
    base = ctypes.addressof(ptrs)
    size = ctypes.sizeof(ctypes.c_void_p) * n_experts
    kind = _expert_ffn(experts, activation, alpha, limit, weight_on_input)
    if kind is None:
        status = _lib().col_moe_experts(_pool_handle(pool), int(t), n_experts, base, base + size, base + 2 * size, dim, ffn,
                                        _ptr(x), n_tok, _ptr(expert_of), _ptr(weight), expert_of.shape[1], _ptr(out))
    else:
        status = _lib().col_moe_experts_ffn(_pool_handle(pool), ctypes.addressof(kind[0]), int(t), n_experts, base,
                                            base + size, base + 2 * size, dim, ffn, _ptr(x), n_tok, _ptr(expert_of),
                                            _ptr(weight), expert_of.shape[1], _ptr(out))
    if status:
        check(status, f"moe_experts {t.name_in_pack}")


def _expert_ffn(experts: "list[ExpertBuffers]", activation: str, alpha: float, limit: float, weight_on_input: bool):
    """(col_expert_ffn, the bias pointer arrays it points into), or None for plain SwiGLU
    experts without biases, weighted at the output (col_moe_experts)."""
    if activation not in EXPERT_ACTIVATION_CODES:
        raise InvalidArgumentError(f"activation must be one of {', '.join(EXPERT_ACTIVATION_CODES)}, got {activation!r}")
    with_bias = [e.gate_bias is not None for e in experts]
    if any(with_bias) and not all(with_bias):
        raise InvalidArgumentError("either every expert of a call has biases or none has")
    if activation == "swiglu" and not any(with_bias) and not weight_on_input:
        return None
    kind = ExpertFfn(activation=EXPERT_ACTIVATION_CODES[activation], alpha=float(alpha), limit=float(limit),
                     weight_on_input=int(bool(weight_on_input)))
    arrays = []
    if any(with_bias):
        for field in ("gate_bias", "up_bias", "down_bias"):
            array = (ctypes.c_void_p * len(experts))(*[getattr(e, field) for e in experts])
            arrays.append(array)
            setattr(kind, field, ctypes.addressof(array))
    return kind, arrays


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis of float32 ``x`` (..., N) with ``weight`` (N); float32 throughout."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim < 1:
        raise InvalidArgumentError("x must be a float32 array")
    n = x.shape[-1]
    w = np.ascontiguousarray(weight, dtype=np.float32)
    if w.shape != (n,):
        raise InvalidArgumentError(f"weight must have shape ({n},), got {w.shape}")
    xc = np.ascontiguousarray(x)
    y = np.empty_like(xc)
    rows = xc.size // n if n else 0
    check(_lib().col_rms_norm(_ptr(xc), _ptr(w), rows, n, float(eps), _ptr(y)), "rms_norm")
    return y


def silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """silu(g) * u elementwise for float32 arrays of one shape, as the fused expert call
    computes it on the active kernel level (see col_silu_mul)."""
    return _gated(g, u, "col_silu_mul")


def gelu_tanh_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """gelu_tanh(g) * u elementwise (transformers' gelu_pytorch_tanh gating) for float32 arrays
    of one shape, as the fused expert call computes it on the active level (see col_gelu_tanh_mul)."""
    return _gated(g, u, "col_gelu_tanh_mul")


def _gated(g: np.ndarray, u: np.ndarray, function: str) -> np.ndarray:
    for name, a in (("g", g), ("u", u)):
        if not isinstance(a, np.ndarray) or a.dtype != np.float32:
            raise InvalidArgumentError(f"{name} must be a float32 array")
    if g.shape != u.shape:
        raise InvalidArgumentError(f"g and u must have the same shape, got {g.shape} and {u.shape}")
    g, u = np.ascontiguousarray(g), np.ascontiguousarray(u)
    h = np.empty_like(g)
    check(getattr(_lib(), function)(_ptr(g), _ptr(u), _ptr(h), g.size), function)
    return h


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half rotary embedding of float32 ``x`` (T, H, Hd) by cos/sin (T, Hr): the first
    Hr <= Hd dims of each head rotate, the rest pass through (partial rotary when Hr < Hd);
    returns a new array."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 3:
        raise InvalidArgumentError("x must be a float32 (T, H, Hd) array")
    T, H, Hd = x.shape
    cos, sin = _f32_matrix(cos, "cos"), _f32_matrix(sin, "sin")
    Hr = cos.shape[1]
    if cos.shape != (T, Hr) or sin.shape != (T, Hr) or Hr > Hd:
        raise InvalidArgumentError(f"cos and sin must be ({T}, Hr) with Hr <= {Hd}, got {cos.shape}, {sin.shape}")
    y = np.array(x, dtype=np.float32, order="C", copy=True)
    check(_lib().col_rope_partial(_ptr(y), T, H, Hd, Hr, _ptr(cos), _ptr(sin)), "rope")
    return y


def attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, positions: np.ndarray, window: int | None,
              scale: float, pool: "ThreadPool | None" = None, *, chunk: int | None = None,
              ring: bool = False) -> np.ndarray:
    """Causal GQA, optionally sliding-window (``window``) or chunked-local (``chunk``):
    ``q`` (Tq, H, Hd), ``keys``/``values`` (S, K, Hd) float32, ``positions`` (Tq) ints; returns
    (Tq, H*Hd) float32. ``ring``: keys/values are a ring buffer of S rows holding key position
    p in row p % S (see col_attention)."""
    for name, a in (("q", q), ("keys", keys), ("values", values)):
        if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.ndim != 3:
            raise InvalidArgumentError(f"{name} must be a 3-D float32 array")
    Tq, H, Hd = q.shape
    S, K = keys.shape[0], keys.shape[1]
    if keys.shape != (S, K, Hd) or values.shape != keys.shape or K == 0 or H % K:
        raise InvalidArgumentError(f"keys/values must be (S, K, {Hd}) with H % K == 0, got {keys.shape}, {values.shape}")
    pos = np.ascontiguousarray(positions, dtype=np.int64)
    if pos.shape != (Tq,):
        raise InvalidArgumentError(f"positions must have shape ({Tq},)")
    q, keys, values = np.ascontiguousarray(q), np.ascontiguousarray(keys), np.ascontiguousarray(values)
    out = np.empty((Tq, H * Hd), dtype=np.float32)
    check(_lib().col_attention(_pool_handle(pool), _ptr(q), _ptr(keys), _ptr(values), Tq, S, H, K, Hd, _ptr(pos),
                               int(window or 0), int(chunk or 0), S if ring else 0, float(scale), _ptr(out)),
          "attention")
    return out


# --------------------------------------------------------------------------------------------
# Fused decoder steps
# --------------------------------------------------------------------------------------------

QK_NORM_CODES = {"none": 0, "full": 1, "head": 2, "head_after_rope": 3}  # enum col_qk_norm


class AttentionLayer(ctypes.Structure):
    """Mirror of col_attention_layer (colibri.h); its size is checked against C at load.
    Build it with attention_layer(), which checks every size once and keeps the arrays it
    points into alive for as long as the structure lives."""

    _fields_ = [
        ("dim", ctypes.c_int64), ("n_heads", ctypes.c_int64), ("n_kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64), ("window", ctypes.c_int64),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("clip_qkv", ctypes.c_float),
        ("qk_norm", ctypes.c_int32), ("qkv_type", ctypes.c_int32), ("o_type", ctypes.c_int32),
        *((name, ctypes.c_void_p) for name in ("norm", "wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo", "q_norm", "k_norm")),
        ("rotary_dim", ctypes.c_int64), ("sinks", ctypes.c_void_p), ("chunk", ctypes.c_int64), ("wg", ctypes.c_void_p),
        ("rope_interleaved", ctypes.c_int32), ("no_rope", ctypes.c_int32),
        ("temp_floor", ctypes.c_float), ("temp_scale", ctypes.c_float),
        ("v_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
    ]


def _f32_vector(a, name: str, n: int) -> np.ndarray:
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.shape != (n,) or not a.flags.c_contiguous:
        raise InvalidArgumentError(f"{name} must be a C-contiguous float32 ({n},) array")
    return a


def attention_layer(dim: int, n_heads: int, n_kv_heads: int, head_dim: int, norm: np.ndarray,
                    qkv_type: TensorType | int | str, wq, wk, wv, o_type: TensorType | int | str, wo, *,
                    eps: float, scale: float, window: int | None = None, clip_qkv: float | None = None,
                    qk_norm: str = "none", q_norm: np.ndarray | None = None, k_norm: np.ndarray | None = None,
                    bq: np.ndarray | None = None, bk: np.ndarray | None = None, bv: np.ndarray | None = None,
                    bo: np.ndarray | None = None, rotary_dim: int = 0, sinks: np.ndarray | None = None,
                    chunk: int | None = None, wg=None, rope_interleaved: bool = False, no_rope: bool = False,
                    temperature: tuple[float, float] | None = None, v_norm: np.ndarray | None = None,
                    post_norm: np.ndarray | None = None) -> AttentionLayer:
    """One layer's attention for attention_block(): ``wq`` (H*Hd, D), ``wk``/``wv`` (K*Hd, D)
    encoded as ``qkv_type``, ``wo`` (D, H*Hd) as ``o_type`` (contiguous buffers, read in place);
    ``norm`` (D) the input RMSNorm; biases and q/k norm weights float32 or None; ``rotary_dim``
    the leading dims of each head RoPE rotates (0: all); ``sinks`` (H) float32 per-head sink
    logits or None; ``chunk`` the chunked-local attention span (None: none); ``wg`` (H*Hd, D) as
    ``qkv_type``: an output gate, the attention output times sigmoid(h wg^T) (Qwen3.5,
    Qwen3-Next), or None; ``rope_interleaved``: RoPE turns pairs (x0, x1), (x2, x3) ...;
    ``no_rope``: none at all; ``temperature`` (floor, scale): queries scaled by attention
    temperature tuning (see col_attention_layer), or None; ``v_norm`` (Hd) the RMSNorm weight
    of each value head, ``post_norm`` (D) that of the attention output before the residual
    add, or None."""
    dim, n_heads, n_kv_heads, head_dim = (_as_count(v, n) for v, n in (
        (dim, "dim"), (n_heads, "n_heads"), (n_kv_heads, "n_kv_heads"), (head_dim, "head_dim")))
    if min(dim, n_heads, n_kv_heads, head_dim) == 0 or n_heads % n_kv_heads or head_dim % 2:
        raise InvalidArgumentError("attention needs dim, heads > 0, n_heads % n_kv_heads == 0 and an even head_dim")
    rotary_dim = _as_count(rotary_dim, "rotary_dim")
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise InvalidArgumentError(f"rotary_dim must be even and at most head_dim {head_dim}, got {rotary_dim}")
    if qk_norm not in QK_NORM_CODES:
        raise InvalidArgumentError(f"qk_norm must be one of {', '.join(QK_NORM_CODES)}, got {qk_norm!r}")
    t_qkv, t_o = _as_type(qkv_type), _as_type(o_type)
    Q, KV = n_heads * head_dim, n_kv_heads * head_dim
    keep = [_f32_vector(norm, "norm", dim)]
    layer = AttentionLayer(dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, window=int(window or 0),
                           eps=float(eps), scale=float(scale), clip_qkv=float(clip_qkv or 0.0),
                           qk_norm=QK_NORM_CODES[qk_norm], qkv_type=int(t_qkv), o_type=int(t_o), norm=_ptr(norm),
                           rotary_dim=rotary_dim, chunk=_as_count(chunk or 0, "chunk"),
                           rope_interleaved=int(bool(rope_interleaved)),
                           no_rope=int(bool(no_rope)))
    if temperature is not None:
        floor, scale_ = (float(v) for v in temperature)
        if not (np.isfinite(floor) and floor > 0 and np.isfinite(scale_)):
            raise InvalidArgumentError(f"temperature needs a floor > 0 and a finite scale, got {temperature}")
        layer.temp_floor, layer.temp_scale = floor, scale_
    matrices = [("wq", wq, t_qkv, Q, dim), ("wk", wk, t_qkv, KV, dim), ("wv", wv, t_qkv, KV, dim), ("wo", wo, t_o, dim, Q)]
    for field, data, t, rows, cols in matrices + ([("wg", wg, t_qkv, Q, dim)] if wg is not None else []):
        raw = _matrix_bytes(data, field, t, rows, cols)
        keep.append(raw)
        setattr(layer, field, _ptr(raw))
    norm_width = {"none": None, "full": (Q, KV), "head": (head_dim, head_dim), "head_after_rope": (head_dim, head_dim)}[qk_norm]
    vectors = [("bq", bq, Q), ("bk", bk, KV), ("bv", bv, KV), ("bo", bo, dim), ("sinks", sinks, n_heads),
               ("v_norm", v_norm, head_dim), ("post_norm", post_norm, dim)]
    if norm_width is not None:
        if q_norm is None or k_norm is None:
            raise InvalidArgumentError(f"qk_norm {qk_norm!r} needs q_norm and k_norm")
        vectors += [("q_norm", q_norm, norm_width[0]), ("k_norm", k_norm, norm_width[1])]
    for field, vector, n in vectors:
        if vector is not None:
            keep.append(_f32_vector(vector, field, n))
            setattr(layer, field, _ptr(vector))
    layer._keep = keep  # the buffers the pointers point into
    return layer


def _f32_out(a, name: str, shape: tuple) -> None:
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or not a.flags.c_contiguous or not a.flags.writeable \
            or a.shape != shape:
        raise InvalidArgumentError(f"{name} must be a writable C-contiguous float32 array of shape {shape}")


def _check_rope_tables(cos: np.ndarray, sin: np.ndarray, T: int, width: int) -> None:
    """cos and sin of T positions for `width` rotated dims, as the attention calls read them."""
    for name, table in (("cos", cos), ("sin", sin)):
        if not isinstance(table, np.ndarray) or table.dtype != np.float32 or table.shape != (T, width) or not table.flags.c_contiguous:
            raise InvalidArgumentError(f"{name} must be a C-contiguous float32 ({T}, {width}) array")


def attention_block(layer: AttentionLayer, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, keys: np.ndarray,
                    values: np.ndarray, n_past: int, pool: "ThreadPool | None" = None, *, ring: bool = False) -> None:
    """x += attention(rms_norm(x)) for T new tokens at positions n_past .., in place (see
    col_attention_block): ``x`` (T, D), ``cos``/``sin`` (T, Hr) (Hr = the layer's rotary_dim or Hd), ``keys``/``values`` the
    layer's whole cache buffers, float32: (capacity >= n_past + T, K, Hd), rows n_past ..
    n_past + T - 1 written; or with ``ring`` a ring buffer of (rows, K, Hd) holding key position
    p in row p % rows, rows >= the layer's window or chunk + T - 1."""
    if not isinstance(layer, AttentionLayer) or not hasattr(layer, "_keep"):
        raise InvalidArgumentError("layer must come from attention_layer()")
    n_past = _as_count(n_past, "n_past")
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        raise InvalidArgumentError("x must be a (T, D) float32 array")
    T, Hd = x.shape[0], layer.head_dim
    Hr = layer.rotary_dim or Hd
    _f32_out(x, "x", (T, layer.dim))
    _check_rope_tables(cos, sin, T, Hr)
    capacity = keys.shape[0] if isinstance(keys, np.ndarray) and keys.ndim == 3 else -1
    spans = [s for s in (layer.window, layer.chunk) if s > 0]
    needed = min(spans) + T - 1 if ring and spans else n_past + T
    if ring and not spans:
        raise InvalidArgumentError("a ring-buffer cache needs a layer with a window or a chunk")
    if capacity < needed:
        raise InvalidArgumentError(f"keys must be a (>= {needed}, K, Hd) array")
    _f32_out(keys, "keys", (capacity, layer.n_kv_heads, Hd))
    _f32_out(values, "values", (capacity, layer.n_kv_heads, Hd))
    check(_lib().col_attention_block(_pool_handle(pool), ctypes.addressof(layer), _ptr(x), T, _ptr(cos), _ptr(sin),
                                     _ptr(keys), _ptr(values), n_past, capacity if ring else 0), "attention_block")


class MlaLayer(ctypes.Structure):
    """Mirror of col_mla_layer (colibri.h); its size is checked against C at load. Build it
    with mla_layer(), which checks every size once and keeps the arrays it points into alive."""

    _fields_ = [
        *((name, ctypes.c_int64) for name in ("dim", "n_heads", "q_rank", "kv_rank", "nope_dim", "rope_dim", "v_dim")),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        *((name, ctypes.c_int32) for name in ("rope_interleaved", "in_type", "qb_type", "kvb_type", "o_type", "reserved")),
        *((name, ctypes.c_void_p) for name in ("norm", "wq_a", "q_a_norm", "wq_b", "wq", "wkv_a", "kv_a_norm", "wkv_b",
                                               "wo", "bo")),
    ]


def mla_layer(dim: int, n_heads: int, q_rank: int, kv_rank: int, nope_dim: int, rope_dim: int, v_dim: int,
              norm: np.ndarray, weights: dict, *, eps: float, scale: float, rope_interleaved: bool,
              bo: np.ndarray | None = None) -> MlaLayer:
    """One layer's latent attention for mla_block() (see col_mla_layer): ``weights`` maps
    "q_a", "q_b" (q_rank > 0) or "q", and "kv_a", "kv_b", "o" to (type, encoded bytes), read
    in place; ``norm`` (D) and the float32 vectors "q_a_norm" (Cq), "kv_a_norm" (C) in
    ``weights`` as plain arrays."""
    dims = [_as_count(v, n) for v, n in ((dim, "dim"), (n_heads, "n_heads"), (q_rank, "q_rank"), (kv_rank, "kv_rank"),
                                         (nope_dim, "nope_dim"), (rope_dim, "rope_dim"), (v_dim, "v_dim"))]
    dim, H, Cq, C, N, R, Vd = dims
    if min(dim, H, C, R, Vd) == 0 or R % 2:
        raise InvalidArgumentError("latent attention needs dim, heads, kv_rank, v_dim > 0 and an even rope_dim > 0")
    QH = H * (N + R)
    matrices = {"kv_a": (C + R, dim), "kv_b": (H * (N + Vd), C), "o": (dim, H * Vd)}
    matrices.update({"q_a": (Cq, dim), "q_b": (QH, Cq)} if Cq else {"q": (QH, dim)})
    if Cq and weights["q_a"][0] != weights["kv_a"][0] or not Cq and weights["q"][0] != weights["kv_a"][0]:
        raise InvalidArgumentError("q_a (or q) and kv_a must have one type")
    keep = [_f32_vector(norm, "norm", dim)]
    layer = MlaLayer(dim=dim, n_heads=H, q_rank=Cq, kv_rank=C, nope_dim=N, rope_dim=R, v_dim=Vd, eps=float(eps),
                     scale=float(scale), rope_interleaved=int(bool(rope_interleaved)), norm=_ptr(norm))
    fields = {"q_a": "wq_a", "q_b": "wq_b", "q": "wq", "kv_a": "wkv_a", "kv_b": "wkv_b", "o": "wo"}
    for name, (rows, cols) in matrices.items():
        type_, data = weights[name]
        raw = _matrix_bytes(data, name, _as_type(type_), rows, cols)
        keep.append(raw)
        setattr(layer, fields[name], _ptr(raw))
    layer.in_type = int(_as_type(weights["kv_a"][0]))
    layer.qb_type = int(_as_type(weights["q_b"][0])) if Cq else 0
    layer.kvb_type = int(_as_type(weights["kv_b"][0]))
    layer.o_type = int(_as_type(weights["o"][0]))
    vectors = [("kv_a_norm", weights["kv_a_norm"], C), ("bo", bo, dim)] + ([("q_a_norm", weights["q_a_norm"], Cq)] if Cq else [])
    for field, vector, n in vectors:
        if vector is not None:
            keep.append(_f32_vector(vector, field, n))
            setattr(layer, field, _ptr(vector))
    layer._keep = keep  # the buffers the pointers point into
    return layer


def mla_block(layer: MlaLayer, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, cache: np.ndarray, n_past: int,
              pool: "ThreadPool | None" = None) -> None:
    """x += latent attention(rms_norm(x)) for T new tokens at positions n_past .., in place
    (see col_mla_block): ``x`` (T, D), ``cos``/``sin`` (T, R), ``cache`` the layer's whole
    latent cache (capacity >= n_past + T, C + R), float32; rows n_past .. n_past + T - 1 of the
    cache are written."""
    if not isinstance(layer, MlaLayer) or not hasattr(layer, "_keep"):
        raise InvalidArgumentError("layer must come from mla_layer()")
    n_past = _as_count(n_past, "n_past")
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        raise InvalidArgumentError("x must be a (T, D) float32 array")
    T, R, L = x.shape[0], layer.rope_dim, layer.kv_rank + layer.rope_dim
    _f32_out(x, "x", (T, layer.dim))
    _check_rope_tables(cos, sin, T, R)
    capacity = cache.shape[0] if isinstance(cache, np.ndarray) and cache.ndim == 2 else -1
    if capacity < n_past + T:
        raise InvalidArgumentError(f"cache must be a (>= {n_past + T}, {L}) array")
    _f32_out(cache, "cache", (capacity, L))
    check(_lib().col_mla_block(_pool_handle(pool), ctypes.addressof(layer), _ptr(x), T, _ptr(cos), _ptr(sin),
                               _ptr(cache), n_past), "mla_block")


class DeltaNetLayer(ctypes.Structure):
    """Mirror of col_deltanet_layer (colibri.h); its size is checked against C at load. Build it
    with deltanet_layer(), which checks every size once and keeps the arrays it points into alive."""

    _fields_ = [
        *((name, ctypes.c_int64) for name in ("dim", "n_k_heads", "n_v_heads", "k_head_dim", "v_head_dim", "conv_kernel")),
        ("eps", ctypes.c_float), ("norm_eps", ctypes.c_float), ("in_type", ctypes.c_int32), ("o_type", ctypes.c_int32),
        *((name, ctypes.c_void_p) for name in ("norm", "wqkv", "wz", "wb", "wa", "conv", "conv_bias", "A_log", "dt_bias",
                                               "gate_norm", "wo")),
    ]


def deltanet_layer(dim: int, n_k_heads: int, n_v_heads: int, k_head_dim: int, v_head_dim: int, conv_kernel: int,
                   input_norm: np.ndarray, weights: dict, eps: float, norm_eps: float) -> DeltaNetLayer:
    """One Gated DeltaNet layer for deltanet_block() (see col_deltanet_layer). ``weights`` maps
    "qkv" (C, D), "z" (Hv*Dv, D), "b" (Hv, D), "a" (Hv, D) -- one type -- and "o" (D, Hv*Dv)
    to (type, encoded bytes), read in place, and the float32 arrays "conv" (C, Kc),
    "conv_bias" (C) (optional), "A_log" (Hv), "dt_bias" (Hv), "norm" (Dv, the gated norm's
    weight); ``input_norm`` (D) is the layer's input RMSNorm weight. C = 2*Hk*Dk + Hv*Dv."""
    D, Hk, Hv, Dk, Dv, Kc = (_as_count(v, n) for v, n in (
        (dim, "dim"), (n_k_heads, "n_k_heads"), (n_v_heads, "n_v_heads"), (k_head_dim, "k_head_dim"),
        (v_head_dim, "v_head_dim"), (conv_kernel, "conv_kernel")))
    if min(D, Hk, Hv, Dk, Dv, Kc) == 0 or Hv % Hk:
        raise InvalidArgumentError(f"a DeltaNet layer needs sizes > 0 and value heads ({Hv}) a multiple of key heads ({Hk})")
    C, Z = 2 * Hk * Dk + Hv * Dv, Hv * Dv
    missing = sorted({"qkv", "z", "b", "a", "o", "conv", "A_log", "dt_bias", "norm"} - set(weights))
    if missing:
        raise InvalidArgumentError(f"DeltaNet weights lack {', '.join(missing)}")
    in_types = {_as_type(weights[name][0]) for name in ("qkv", "z", "b", "a")}
    if len(in_types) != 1:
        raise InvalidArgumentError("qkv, z, b and a must have one type (one quantization of the input)")
    keep = [_f32_vector(input_norm, "input_norm", D)]
    layer = DeltaNetLayer(dim=D, n_k_heads=Hk, n_v_heads=Hv, k_head_dim=Dk, v_head_dim=Dv, conv_kernel=Kc, eps=float(eps),
                          norm_eps=float(norm_eps), in_type=int(in_types.pop()), o_type=int(_as_type(weights["o"][0])),
                          norm=_ptr(input_norm))
    fields = {"qkv": "wqkv", "z": "wz", "b": "wb", "a": "wa", "o": "wo"}
    for name, (rows, cols) in {"qkv": (C, D), "z": (Z, D), "b": (Hv, D), "a": (Hv, D), "o": (D, Z)}.items():
        type_, data = weights[name]
        raw = _matrix_bytes(data, name, _as_type(type_), rows, cols)
        keep.append(raw)
        setattr(layer, fields[name], _ptr(raw))
    conv = weights["conv"]
    if not isinstance(conv, np.ndarray) or conv.dtype != np.float32 or conv.shape != (C, Kc) or not conv.flags.c_contiguous:
        raise InvalidArgumentError(f"conv must be a C-contiguous float32 ({C}, {Kc}) array")
    keep.append(conv)
    layer.conv = _ptr(conv)
    vectors = [("conv_bias", "conv_bias", C), ("A_log", "A_log", Hv), ("dt_bias", "dt_bias", Hv), ("norm", "gate_norm", Dv)]
    for name, field, n in vectors:
        vector = weights.get(name)
        if vector is not None:
            keep.append(_f32_vector(vector, name, n))
            setattr(layer, field, _ptr(vector))
    layer._keep = keep  # the buffers the pointers point into
    return layer


def deltanet_block(layer: DeltaNetLayer, x: np.ndarray, conv_state: np.ndarray, recurrent_state: np.ndarray,
                   pool: "ThreadPool | None" = None) -> None:
    """x += Gated DeltaNet(rms_norm(x)) for the T new tokens of one sequence, in place (see
    col_deltanet_block): ``x`` (T, D); the sequence's ``conv_state`` (Kc - 1, C) and
    ``recurrent_state`` (Hv, Dk, Dv), float32, zeros for a new sequence, updated in place."""
    if not isinstance(layer, DeltaNetLayer) or not hasattr(layer, "_keep"):
        raise InvalidArgumentError("layer must come from deltanet_layer()")
    if not isinstance(x, np.ndarray) or x.ndim != 2:
        raise InvalidArgumentError("x must be a (T, D) float32 array")
    Hk, Hv, Dk, Dv = layer.n_k_heads, layer.n_v_heads, layer.k_head_dim, layer.v_head_dim
    C = 2 * Hk * Dk + Hv * Dv
    _f32_out(x, "x", (x.shape[0], layer.dim))
    _f32_out(conv_state, "conv_state", (layer.conv_kernel - 1, C))
    _f32_out(recurrent_state, "recurrent_state", (Hv, Dk, Dv))
    check(_lib().col_deltanet_block(_pool_handle(pool), ctypes.addressof(layer), _ptr(x), x.shape[0],
                                    _ptr(conv_state) if conv_state.size else None, _ptr(recurrent_state)),
          "deltanet_block")


def moe_route(type_: TensorType | int | str, data, n_experts: int, dim: int, x: np.ndarray, top_k: int,
              normalize: bool, pool: "ThreadPool | None" = None) -> tuple[np.ndarray, np.ndarray]:
    """A MoE router (see col_moe_route): ``data`` the router (E, D) encoded as ``type_``,
    ``x`` float32 (T, D). Returns (experts int32 (T, A), weights float32 (T, A)): per token
    the top_k experts of the softmax over x @ router^T, best first (lower index on ties),
    and their probabilities, renormalised to sum 1 if ``normalize``."""
    t = _as_type(type_)
    n_experts, dim, top_k = _as_count(n_experts, "n_experts"), _as_count(dim, "dim"), _as_count(top_k, "top_k")
    if not 1 <= top_k <= n_experts:
        raise InvalidArgumentError(f"top_k must be in [1, {n_experts}], got {top_k}")
    if type(data) is np.ndarray and data.flags.c_contiguous and not data.dtype.hasobject:
        raw = data
    else:
        raw = _byte_view(data, "data")
    if raw.nbytes != n_experts * t.row_bytes(dim):
        raise InvalidArgumentError(f"router has {raw.nbytes} bytes, {t.name_in_pack} ({n_experts}, {dim}) needs {n_experts * t.row_bytes(dim)}")
    x = _f32_matrix(x, "x", cols=dim)
    n_tok = x.shape[0]
    experts = np.empty((n_tok, top_k), dtype=np.int32)
    weights = np.empty((n_tok, top_k), dtype=np.float32)
    status = _lib().col_moe_route(_pool_handle(pool), int(t), _ptr(raw), n_experts, dim, _ptr(x), n_tok, top_k,
                                  int(bool(normalize)), _ptr(experts), _ptr(weights))
    if status:
        check(status, f"moe_route {t.name_in_pack}")
    return experts, weights


ROUTER_SCORING_CODES = {"softmax": 0, "sigmoid": 1, "topk_softmax": 2, "topk_sigmoid": 3}  # enum col_router_scoring
GROUP_SCORE_CODES = {"max": 0, "top2_sum": 1}  # enum col_group_score


class MoeRouter(ctypes.Structure):
    """Mirror of col_moe_router (colibri.h); its size is checked against C at load. Build it
    with moe_router(), which checks every size once and keeps the arrays it points into alive."""

    _fields_ = [
        ("n_experts", ctypes.c_int64), ("dim", ctypes.c_int64), ("top_k", ctypes.c_int64),
        ("n_groups", ctypes.c_int64), ("groups_kept", ctypes.c_int64),
        ("type", ctypes.c_int32), ("scoring", ctypes.c_int32), ("group_score", ctypes.c_int32),
        ("normalize", ctypes.c_int32), ("scaling", ctypes.c_float),
        ("weight", ctypes.c_void_p), ("choice_bias", ctypes.c_void_p), ("logit_bias", ctypes.c_void_p),
        ("expert_scale", ctypes.c_void_p),
    ]


def moe_router(type_: TensorType | int | str, data, n_experts: int, dim: int, top_k: int, *, normalize: bool,
               scoring: str = "softmax", choice_bias: np.ndarray | None = None, n_groups: int = 1,
               groups_kept: int = 1, group_score: str = "max", scaling: float = 1.0,
               logit_bias: np.ndarray | None = None, expert_scale: np.ndarray | None = None) -> MoeRouter:
    """A MoE layer's router for moe_router_route() (see col_moe_router_route): ``data`` the
    router (E, D) encoded as ``type_``, read in place; ``choice_bias``, ``logit_bias`` and
    ``expert_scale`` float32 (E) or None."""
    t = _as_type(type_)
    n_experts, dim, top_k = _as_count(n_experts, "n_experts"), _as_count(dim, "dim"), _as_count(top_k, "top_k")
    n_groups, groups_kept = _as_count(n_groups, "n_groups"), _as_count(groups_kept, "groups_kept")
    if scoring not in ROUTER_SCORING_CODES or group_score not in GROUP_SCORE_CODES:
        raise InvalidArgumentError(f"scoring must be one of {', '.join(ROUTER_SCORING_CODES)} and group_score one of "
                                   f"{', '.join(GROUP_SCORE_CODES)}, got {scoring!r}, {group_score!r}")
    if n_experts == 0 or n_groups == 0 or n_experts % n_groups or not 1 <= groups_kept <= n_groups:
        raise InvalidArgumentError(f"{n_experts} experts in {n_groups} groups, {groups_kept} kept: need groups that "
                                   "divide the experts and 1 <= kept <= groups")
    if not 1 <= top_k <= groups_kept * (n_experts // n_groups):
        raise InvalidArgumentError(f"top_k must be in [1, {groups_kept * (n_experts // n_groups)}], got {top_k}")
    if group_score == "top2_sum" and n_groups > 1 and n_experts // n_groups < 2:
        raise InvalidArgumentError("top2_sum group scores need at least two experts per group")
    if not np.isfinite(scaling):
        raise InvalidArgumentError(f"scaling must be finite, got {scaling}")
    raw = _byte_view(data, "data")
    if raw.nbytes != n_experts * t.row_bytes(dim):
        raise InvalidArgumentError(f"router has {raw.nbytes} bytes, {t.name_in_pack} ({n_experts}, {dim}) needs {n_experts * t.row_bytes(dim)}")
    keep = [raw]
    router = MoeRouter(n_experts=n_experts, dim=dim, top_k=top_k, n_groups=n_groups, groups_kept=groups_kept, type=int(t),
                       scoring=ROUTER_SCORING_CODES[scoring], group_score=GROUP_SCORE_CODES[group_score],
                       normalize=int(bool(normalize)), scaling=float(scaling), weight=_ptr(raw))
    if choice_bias is not None:
        keep.append(_f32_vector(choice_bias, "choice_bias", n_experts))
        router.choice_bias = _ptr(choice_bias)
    if logit_bias is not None:
        keep.append(_f32_vector(logit_bias, "logit_bias", n_experts))
        router.logit_bias = _ptr(logit_bias)
    if expert_scale is not None:
        keep.append(_f32_vector(expert_scale, "expert_scale", n_experts))
        router.expert_scale = _ptr(expert_scale)
    router._keep = keep  # the buffers the pointers point into
    return router


def moe_router_route(router: MoeRouter, x: np.ndarray, pool: "ThreadPool | None" = None) -> tuple[np.ndarray, np.ndarray]:
    """Route every token of ``x`` float32 (T, D): (experts int32 (T, A) best first, weights
    float32 (T, A)), one libcolibri call (see col_moe_router_route)."""
    if not isinstance(router, MoeRouter) or not hasattr(router, "_keep"):
        raise InvalidArgumentError("router must come from moe_router()")
    x = _f32_matrix(x, "x", cols=router.dim)
    n_tok = x.shape[0]
    experts = np.empty((n_tok, router.top_k), dtype=np.int32)
    weights = np.empty((n_tok, router.top_k), dtype=np.float32)
    status = _lib().col_moe_router_route(_pool_handle(pool), ctypes.addressof(router), _ptr(x), n_tok, _ptr(experts),
                                         _ptr(weights))
    if status:
        check(status, "moe_router_route")
    return experts, weights


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


# ============================================================================================
# ---- AEPC: slab pool, loader, expert cache ----
# Bindings for the section of colibri.h with the same title. Appended as one block: it adds
# its own signatures to _SIGNATURES and its status codes to _ERROR_BY_STATUS, and changes
# nothing above. Shape letters: S slots, L layers, E experts per layer, N experts in a call.
# ============================================================================================


class ReadError(ColibriError, OSError):
    """COL_EIO (5): a read failed or came back short."""

    status = 5


class ChecksumError(ColibriError):
    """COL_ECHECKSUM (6): a record's bytes do not match its crc32c."""

    status = 6


class NoFreeSlotError(ColibriError):
    """COL_EBUSY (7): every slot of the cache is pinned or loading."""

    status = 7


class SystemResourceError(ColibriError):
    """COL_ESYSTEM (8): the OS refused a required resource (mlock, hugetlb pages, O_DIRECT,
    a thread). ``info`` holds the object's info struct as a dict, when there is one."""

    status = 8
    info: dict | None = None


_AEPC_STATUS_TEXT = {
    5: "I/O error",
    6: "checksum mismatch",
    7: "no free or evictable slot",
    8: "a required system resource was refused",
}
for _cls in (ReadError, ChecksumError, NoFreeSlotError, SystemResourceError):
    _ERROR_BY_STATUS[_cls.status] = _cls


def _aepc_check(status: int, what: str) -> None:
    """check() with the AEPC status texts (col_status_string predates these codes)."""
    if status == 0:
        return
    if status in _AEPC_STATUS_TEXT:
        raise _ERROR_BY_STATUS[status](f"{what}: {_AEPC_STATUS_TEXT[status]} (status {status})", status)
    check(status, what)


class AepcMode(enum.IntEnum):
    """col_aepc_mode: how hard to try for hugetlb pages, THP, mlock, O_DIRECT."""

    OFF = 0
    TRY = 1
    REQUIRED = 2


class SlabBacking(enum.IntEnum):
    PAGES = 0
    THP = 1
    HUGETLB = 2


class CachePolicy(enum.IntEnum):
    LRU = 0
    LFRU = 1


LATENCY_BUCKETS = 96  # COL_LATENCY_BUCKETS


def latency_bucket_lower_us(bucket: int) -> float:
    """Lower edge (microseconds) of a read-latency histogram bucket (see colibri.h)."""
    if bucket < 4:
        return 0.0
    return ((4 + bucket % 4) << (bucket // 4)) / 8.0


class _SizedStructure(ctypes.Structure):
    """A Structure whose size is checked against the C `size_fn` on first use."""

    _size_fn = ""


class SlabParams(_SizedStructure):
    _size_fn = "col_slab_params_size"
    _fields_ = [("slot_bytes", ctypes.c_int64), ("n_slots", ctypes.c_int64), ("hugetlb", ctypes.c_int32),
                ("thp", ctypes.c_int32), ("lock", ctypes.c_int32), ("reserved", ctypes.c_int32)]


class SlabInfo(_SizedStructure):
    _size_fn = "col_slab_info_size"
    _fields_ = [("slot_bytes", ctypes.c_int64), ("n_slots", ctypes.c_int64), ("region_bytes", ctypes.c_int64),
                ("n_free", ctypes.c_int64), ("backing", ctypes.c_int32), ("locked", ctypes.c_int32),
                ("hugetlb_errno", ctypes.c_int32), ("thp_errno", ctypes.c_int32), ("lock_errno", ctypes.c_int32),
                ("mmap_errno", ctypes.c_int32)]


class LoaderParams(_SizedStructure):
    _size_fn = "col_loader_params_size"
    _fields_ = [("max_queue_depth", ctypes.c_int32), ("queue_depth", ctypes.c_int32), ("direct", ctypes.c_int32),
                ("reserved", ctypes.c_int32)]


class LoaderInfo(_SizedStructure):
    _size_fn = "col_loader_info_size"
    _fields_ = [("direct", ctypes.c_int32), ("direct_errno", ctypes.c_int32), ("queue_depth", ctypes.c_int32),
                ("max_queue_depth", ctypes.c_int32), ("reads", ctypes.c_int64), ("bytes_read", ctypes.c_int64),
                ("failures", ctypes.c_int64), ("busy_ns", ctypes.c_int64), ("file_bytes", ctypes.c_int64)]


class ReadRequest(_SizedStructure):
    _size_fn = "col_read_size"
    _fields_ = [("dst", ctypes.c_void_p), ("offset", ctypes.c_int64), ("length", ctypes.c_int64),
                ("crc32c", ctypes.c_uint32), ("reserved", ctypes.c_int32)]


class ReadResult(_SizedStructure):
    _size_fn = "col_read_result_size"
    _fields_ = [("status", ctypes.c_int32), ("sys_errno", ctypes.c_int32), ("crc32c", ctypes.c_uint32),
                ("reserved", ctypes.c_int32), ("latency_ns", ctypes.c_int64)]


class ExpertCacheParams(_SizedStructure):
    _size_fn = "col_expert_cache_params_size"
    _fields_ = [("n_layers", ctypes.c_int32), ("n_experts", ctypes.c_int32), ("policy", ctypes.c_int32),
                ("wait_for_pins", ctypes.c_int32)]


class ExpertCacheLayerStats(_SizedStructure):
    _size_fn = "col_expert_cache_layer_stats_size"
    _fields_ = [(name, ctypes.c_int64) for name in (
        "hits", "inflight_hits", "misses", "loads", "load_failures", "bytes_read", "evictions",
        "prefetch_issued", "prefetch_useful", "prefetch_skipped")] + [("latency_us", ctypes.c_int64 * LATENCY_BUCKETS)]


class ExpertLoadResult(_SizedStructure):
    _size_fn = "col_expert_load_result_size"
    _fields_ = [("status", ctypes.c_int32), ("sys_errno", ctypes.c_int32), ("crc32c", ctypes.c_uint32),
                ("reserved", ctypes.c_int32)]


# col_expert_record as a numpy dtype, so an index of L * E records is built without a Python loop
EXPERT_RECORD_DTYPE = np.dtype([("offset", "<i8"), ("length", "<i8"), ("crc32c", "<u4"), ("reserved", "<i4")])

_AEPC_STRUCTS = (SlabParams, SlabInfo, LoaderParams, LoaderInfo, ReadRequest, ReadResult, ExpertCacheParams,
                 ExpertCacheLayerStats, ExpertLoadResult)

_vp, _i32, _i64, _sz = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_size_t
_i32_p = ctypes.POINTER(ctypes.c_int32)
_SIGNATURES.update({
    **{s._size_fn: (_sz, []) for s in _AEPC_STRUCTS},
    "col_expert_record_size": (_sz, []),
    "col_slab_default_params": (SlabParams, []),
    "col_slab_create": (ctypes.c_int, [ctypes.POINTER(SlabParams), ctypes.POINTER(_vp), ctypes.POINTER(SlabInfo)]),
    "col_slab_destroy": (None, [_vp]),
    "col_slab_get_info": (ctypes.c_int, [_vp, ctypes.POINTER(SlabInfo)]),
    "col_slab_data": (_vp, [_vp]),
    "col_slab_slot_alloc": (ctypes.c_int, [_vp, _i32_p]),
    "col_slab_slot_free": (ctypes.c_int, [_vp, _i32]),
    "col_loader_default_params": (LoaderParams, []),
    "col_loader_create": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(LoaderParams), ctypes.POINTER(_vp), _i32_p]),
    "col_loader_destroy": (None, [_vp]),
    "col_loader_get_info": (ctypes.c_int, [_vp, ctypes.POINTER(LoaderInfo)]),
    "col_loader_set_queue_depth": (ctypes.c_int, [_vp, _i32]),
    # (loader, reads (N), n, results (N))
    "col_loader_read": (ctypes.c_int, [_vp, _vp, _i32, _vp]),
    "col_expert_cache_default_params": (ExpertCacheParams, []),
    # (params, records (L * E), slab, loader, out)
    "col_expert_cache_create": (ctypes.c_int, [ctypes.POINTER(ExpertCacheParams), _vp, _vp, _vp, ctypes.POINTER(_vp)]),
    "col_expert_cache_destroy": (None, [_vp]),
    # (cache, layer, experts (N) i32, n, slots (N) i32 out)
    "col_expert_cache_acquire": (ctypes.c_int, [_vp, _i32, _vp, _i32, _vp]),
    # (cache, slots (N), n, results (N) out or NULL)
    "col_expert_cache_wait": (ctypes.c_int, [_vp, _vp, _i32, _vp]),
    "col_expert_cache_release": (ctypes.c_int, [_vp, _vp, _i32]),
    # (cache, layer, experts (N), n, issued out)
    "col_expert_cache_prefetch": (ctypes.c_int, [_vp, _i32, _vp, _i32, _i32_p]),
    "col_expert_cache_get_stats": (ctypes.c_int, [_vp, _i32, ctypes.POINTER(ExpertCacheLayerStats)]),
    "col_expert_cache_reset_stats": (None, [_vp]),
    "col_expert_cache_count": (ctypes.c_int, [_vp, _i32_p, _i32_p]),
    "col_expert_cache_contains": (ctypes.c_int, [_vp, _i32, _i32]),
    "col_expert_cache_set_policy": (ctypes.c_int, [_vp, _i32]),
})

_aepc_checked = False


def _aepc_lib() -> ctypes.CDLL:
    """The library, after checking every AEPC Structure's size against the size C exports."""
    global _aepc_checked
    lib = _lib()
    if not _aepc_checked:
        for struct in _AEPC_STRUCTS:
            c_size = int(getattr(lib, struct._size_fn)())
            if c_size != ctypes.sizeof(struct):
                raise LibraryNotFoundError(
                    f"{struct.__name__} is {ctypes.sizeof(struct)} bytes here, {c_size} in libcolibri: "
                    "the build is stale, run `pip install -e .` again")
        if int(lib.col_expert_record_size()) != EXPERT_RECORD_DTYPE.itemsize:
            raise LibraryNotFoundError("col_expert_record size differs from EXPERT_RECORD_DTYPE: stale build")
        _aepc_checked = True
    return lib


def _struct_dict(s: ctypes.Structure) -> dict:
    return {name: getattr(s, name) for name, *_ in s._fields_ if name != "reserved"}


def _i32_array(values, name: str) -> np.ndarray:
    arr = np.ascontiguousarray(np.asarray(values, dtype=np.int64).reshape(-1))
    if arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
        raise InvalidArgumentError(f"{name} must fit in int32")
    return arr.astype(np.int32)


class Slab:
    """One col_slab: a region of ``n_slots`` slots of ``slot_bytes``, and its free map.

    ``data`` is a uint8 (S * slot_bytes,) view of the region, valid until close()."""

    _handle = None  # set once the C object exists (close() and __del__ check it)

    def __init__(self, slot_bytes: int, n_slots: int, hugetlb: AepcMode = AepcMode.TRY,
                 thp: AepcMode = AepcMode.TRY, lock: AepcMode = AepcMode.TRY) -> None:
        lib = _aepc_lib()
        params = lib.col_slab_default_params()
        params.slot_bytes = _as_count(slot_bytes, "slot_bytes")
        params.n_slots = _as_count(n_slots, "n_slots")
        params.hugetlb, params.thp, params.lock = int(hugetlb), int(thp), int(lock)
        handle, info = _vp(), SlabInfo()
        status = lib.col_slab_create(ctypes.byref(params), ctypes.byref(handle), ctypes.byref(info))
        if status != 0:
            try:
                _aepc_check(status, f"slab of {n_slots} x {slot_bytes} bytes")
            except ColibriError as exc:
                exc.info = _struct_dict(info)
                raise
        self._handle = handle
        self.slot_bytes = int(slot_bytes)
        self.n_slots = int(n_slots)
        base = lib.col_slab_data(handle)
        self.data = np.ctypeslib.as_array((ctypes.c_uint8 * (self.slot_bytes * self.n_slots)).from_address(base))

    @property
    def handle(self) -> ctypes.c_void_p:
        if not self._handle:
            raise InvalidArgumentError("the slab is closed")
        return self._handle

    def info(self) -> dict:
        """backing (SlabBacking), locked, region_bytes, n_free and the errno of each refusal."""
        info = SlabInfo()
        _aepc_check(_aepc_lib().col_slab_get_info(self.handle, ctypes.byref(info)), "slab info")
        return _struct_dict(info)

    def alloc(self) -> int:
        """Takes the lowest free slot; NoFreeSlotError when none is free."""
        slot = ctypes.c_int32(-1)
        _aepc_check(_aepc_lib().col_slab_slot_alloc(self.handle, ctypes.byref(slot)), "slab slot alloc")
        return slot.value

    def free(self, slot: int) -> None:
        _aepc_check(_aepc_lib().col_slab_slot_free(self.handle, int(slot)), f"slab slot free {slot}")

    def close(self) -> None:
        if self._handle:
            self.data = None
            _aepc_lib().col_slab_destroy(self._handle)
            self._handle = None

    def __del__(self) -> None:
        self.close()


class Loader:
    """One col_loader on ``path``: I/O threads reading records with O_DIRECT, crc32c checked."""

    _handle = None  # set once the C object exists (close() and __del__ check it)

    def __init__(self, path: str | os.PathLike, queue_depth: int = 16, max_queue_depth: int = 32,
                 direct: AepcMode = AepcMode.TRY) -> None:
        lib = _aepc_lib()
        params = lib.col_loader_default_params()
        params.queue_depth, params.max_queue_depth, params.direct = int(queue_depth), int(max_queue_depth), int(direct)
        handle, err = _vp(), ctypes.c_int32(0)
        status = lib.col_loader_create(os.fsencode(path), ctypes.byref(params), ctypes.byref(handle), ctypes.byref(err))
        if status in (5, 8) and err.value:
            cls = ReadError if status == 5 else SystemResourceError
            raise cls(f"cannot open {path} for expert reads: {os.strerror(err.value)} (errno {err.value})", status)
        _aepc_check(status, f"loader on {path}")
        self._handle = handle
        self.path = Path(path)

    @property
    def handle(self) -> ctypes.c_void_p:
        if not self._handle:
            raise InvalidArgumentError("the loader is closed")
        return self._handle

    def info(self) -> dict:
        info = LoaderInfo()
        _aepc_check(_aepc_lib().col_loader_get_info(self.handle, ctypes.byref(info)), "loader info")
        return _struct_dict(info)

    def set_queue_depth(self, depth: int) -> None:
        _aepc_check(_aepc_lib().col_loader_set_queue_depth(self.handle, int(depth)), f"loader queue depth {depth}")

    def read(self, requests: list[tuple[np.ndarray, int, int, int]]) -> tuple[int, list[dict]]:
        """Reads each (dst uint8 array, offset, length, crc32c) and waits for all (GIL
        released). Returns (status of the first failure or 0, a result dict per read)."""
        n = len(requests)
        reads, results = (ReadRequest * n)(), (ReadResult * n)()
        for i, (dst, offset, length, crc) in enumerate(requests):
            if not isinstance(dst, np.ndarray) or not dst.flags.c_contiguous or dst.nbytes < length:
                raise InvalidArgumentError(f"read {i}: dst must be a contiguous array of at least {length} bytes")
            reads[i].dst, reads[i].offset, reads[i].length, reads[i].crc32c = dst.ctypes.data, offset, length, crc
        status = _aepc_lib().col_loader_read(self.handle, ctypes.addressof(reads), n, ctypes.addressof(results))
        if status not in (0, 5, 6):
            _aepc_check(status, "loader read")
        return status, [_struct_dict(r) for r in results]

    def close(self) -> None:
        if self._handle:
            _aepc_lib().col_loader_destroy(self._handle)
            self._handle = None

    def __del__(self) -> None:
        self.close()


class ExpertCacheCore:
    """One col_expert_cache over a Slab and a Loader (C keeps them alive until it is closed).

    ``records`` is an EXPERT_RECORD_DTYPE array (L, E): where each record lives.
    ``wait_for_pins``: acquire waits for other threads' releases instead of raising
    NoFreeSlotError (never acquire twice in one thread without releasing, then)."""

    _handle = None  # set once the C object exists (close() and __del__ check it)

    def __init__(self, slab: Slab, loader: Loader, records: np.ndarray, policy: CachePolicy = CachePolicy.LRU,
                 wait_for_pins: bool = False) -> None:
        lib = _aepc_lib()
        if not isinstance(records, np.ndarray) or records.dtype != EXPERT_RECORD_DTYPE or records.ndim != 2:
            raise InvalidArgumentError("records must be an (L, E) array of EXPERT_RECORD_DTYPE")
        self._records = np.ascontiguousarray(records)
        params = lib.col_expert_cache_default_params()
        params.n_layers, params.n_experts, params.policy = records.shape[0], records.shape[1], int(policy)
        params.wait_for_pins = int(bool(wait_for_pins))
        handle = _vp()
        _aepc_check(lib.col_expert_cache_create(ctypes.byref(params), self._records.ctypes.data, slab.handle,
                                                loader.handle, ctypes.byref(handle)), "expert cache")
        self._handle = handle
        self.n_layers, self.n_experts = records.shape
        self._slab, self._loader = slab, loader  # kept alive for as long as the cache

    @property
    def handle(self) -> ctypes.c_void_p:
        if not self._handle:
            raise InvalidArgumentError("the expert cache is closed")
        return self._handle

    def acquire(self, layer: int, experts) -> np.ndarray:
        """Pins the N distinct ``experts`` of ``layer`` and starts the reads of the misses;
        returns their slots, int32 (N,). NoFreeSlotError: not enough unpinned slots (nothing
        stays pinned)."""
        ids = _i32_array(experts, "experts")
        slots = np.empty(ids.size, dtype=np.int32)
        _aepc_check(_aepc_lib().col_expert_cache_acquire(self.handle, int(layer), ids.ctypes.data, ids.size,
                                                         slots.ctypes.data), f"acquire layer {layer}")
        return slots

    def wait(self, slots: np.ndarray) -> tuple[int, list[dict]]:
        """Blocks (GIL released) until every slot is loaded or failed: (first failure status
        or 0, per-slot {status, sys_errno, crc32c})."""
        slots = _i32_array(slots, "slots")
        results = (ExpertLoadResult * slots.size)()
        status = _aepc_lib().col_expert_cache_wait(self.handle, slots.ctypes.data, slots.size, ctypes.addressof(results))
        if status not in (0, 5, 6):
            _aepc_check(status, "wait")
        return status, [_struct_dict(r) for r in results]

    def release(self, slots: np.ndarray) -> None:
        slots = _i32_array(slots, "slots")
        _aepc_check(_aepc_lib().col_expert_cache_release(self.handle, slots.ctypes.data, slots.size), "release")

    def prefetch(self, layer: int, experts) -> int:
        """Starts reads of those experts not in the cache, without pinning; returns reads started."""
        ids = _i32_array(experts, "experts")
        issued = ctypes.c_int32(0)
        _aepc_check(_aepc_lib().col_expert_cache_prefetch(self.handle, int(layer), ids.ctypes.data, ids.size,
                                                          ctypes.byref(issued)), f"prefetch layer {layer}")
        return issued.value

    def layer_stats(self, layer: int) -> dict:
        """Counters of one layer; ``latency_us`` is the histogram as a list of LATENCY_BUCKETS."""
        st = ExpertCacheLayerStats()
        _aepc_check(_aepc_lib().col_expert_cache_get_stats(self.handle, int(layer), ctypes.byref(st)), "stats")
        out = _struct_dict(st)
        out["latency_us"] = list(st.latency_us)
        return out

    def reset_stats(self) -> None:
        _aepc_lib().col_expert_cache_reset_stats(self.handle)

    def count(self) -> tuple[int, int]:
        """(experts resident or loading, slots pinned)."""
        resident, pinned = ctypes.c_int32(0), ctypes.c_int32(0)
        _aepc_check(_aepc_lib().col_expert_cache_count(self.handle, ctypes.byref(resident), ctypes.byref(pinned)), "count")
        return resident.value, pinned.value

    def contains(self, layer: int, expert: int) -> bool:
        return bool(_aepc_lib().col_expert_cache_contains(self.handle, int(layer), int(expert)))

    def set_policy(self, policy: CachePolicy) -> None:
        _aepc_check(_aepc_lib().col_expert_cache_set_policy(self.handle, int(policy)), f"policy {policy}")

    def close(self) -> None:
        if self._handle:
            _aepc_lib().col_expert_cache_destroy(self._handle)
            self._handle = None

    def __del__(self) -> None:
        self.close()
