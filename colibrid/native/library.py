"""Loading libcolibri: where the library is, every function's ctypes signature, the ABI
checks made at load (struct sizes), the status check every binding uses, and the kernel
level chosen at load ($COLIBRI_KERNELS).

ctypes.CDLL releases the GIL for the duration of every call, so kernels run in parallel
with other Python threads."""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
import threading
from pathlib import Path

from colibrid.native.errors import _ERROR_BY_STATUS, ColibriError, InvalidArgumentError, LibraryNotFoundError


LIBRARY_ENV = "COLIBRI_LIBRARY"  # path of a libcolibri build to load instead of the packaged one


def status_error(status: int, what: str, sys_errno: int = 0, lib: ctypes.CDLL | None = None) -> ColibriError:
    """The exception a non-zero status becomes: the ColibriError subclass of the code, with
    ``what`` (the call and its arguments), col_status_string's text and the code, then the
    OS's words for ``sys_errno`` when the function reported an errno. ``lib``: the library
    being loaded, before _lib() hands it out."""
    text = (lib or _lib()).col_status_string(status).decode()
    message = f"{what}: {text} (status {status})"
    if sys_errno:
        message += f": {os.strerror(sys_errno)} (errno {sys_errno})"
    return _ERROR_BY_STATUS.get(status, ColibriError)(message, status)


def check(status: int, what: str = "libcolibri", sys_errno: int = 0) -> None:
    """Raises status_error(status, what, sys_errno) for a non-zero status; returns None for
    COL_OK (0). Hot paths test ``if status:`` themselves and raise status_error, so that the
    message is formatted only on failure."""
    if status:
        raise status_error(status, what, sys_errno)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

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
    # (pool, src, rows, cols, type, dst (R, row_bytes))
    "col_convert": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p]),
    "col_kernels_get": (ctypes.c_int, []),
    "col_kernels_supported": (ctypes.c_int, [ctypes.c_int]),
    "col_kernels_set": (ctypes.c_int, [ctypes.c_int]),
    "col_kernels_name": (ctypes.c_char_p, [ctypes.c_int]),
    "col_pool_create": (ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]),
    "col_pool_destroy": (None, [ctypes.c_void_p]),
    "col_pool_n_threads": (ctypes.c_int, [ctypes.c_void_p]),
    "col_pool_worker_cpu": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int]),
    # (pool, type, n_experts, gate (E) ptrs, up (E) ptrs, down (E) ptrs, D, F, x (T, D) f32, n_tok,
    #  expert_of (T, A) i32, weight (T, A) f32, n_slots, out (T, D) f32)
    "col_moe_experts": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_int64, ctypes.c_void_p]),
    # (pool, ffn_kind, type, n_experts, gate, up, down, D, F, x, n_tok, expert_of, weight, n_slots, out): as col_moe_experts
    "col_moe_experts_ffn": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                           ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]),
    # (x (R, N) f32, weight (N) f32, rows, n, eps, y (R, N) f32)
    "col_rms_norm": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p]),
    # (c (N) f64 in place, n, u, position i64 out)
    "col_draw_cumulative": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_void_p]),
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
    # (pool, layer, x (T, D) f32 in place, n_tok, cos (T, Hd), sin (T, Hd), keys (>= S or ring_rows, K, Hd), vals, n_past,
    #  ring_rows (0: a flat cache))
    "col_attention_block": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                           ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]),
    # (pool, layer, x (T, D), cos, sin (T, Hr), seqs (N) col_attention_seq, N)
    "col_attention_block_batch": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]),
    # (pool, type, router (E, row_bytes(D)), E, D, x (T, D) f32, n_tok, top_k, normalize, experts (T, A) i32, weights (T, A) f32)
    "col_moe_route": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                     ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]),
    # (pool, layer, x (T, D) f32 in place, n_tok, cos (T, R), sin (T, R), cache (>= S, C + R) f32, n_past)
    "col_mla_block": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]),
    # (pool, layer, x (T, D) f32 in place, n_tok, conv_state (Kc - 1, C) f32, recurrent_state (Hv, Dk, Dv) f32)
    "col_deltanet_block": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                          ctypes.c_void_p]),
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
    if status:
        raise status_error(status, f"{KERNELS_ENV}={wanted} on this CPU", lib=lib)


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


# The ABI check: every ctypes mirror of a C struct (and numpy dtype of one) with the
# function that returns the C sizeof, as (name, size here, C function). Checked once at load,
# so a stale build fails there with a message, not later with a corrupted call.
_MIRRORED_SIZES: list[tuple[str, int, str]] = []


def mirrors_c_struct(size_fn: str):
    """Class decorator for a ctypes Structure mirroring a C struct whose sizeof libcolibri
    exports as ``size_fn`` (declared here, no _SIGNATURES entry needed)."""

    def register(struct: type[ctypes.Structure]) -> type[ctypes.Structure]:
        mirrored_size(struct.__name__, ctypes.sizeof(struct), size_fn)
        return struct

    return register


def mirrored_size(name: str, size_bytes: int, size_fn: str) -> None:
    """Registers ``name`` (a Structure or a record dtype) of ``size_bytes`` for the check at load."""
    _SIGNATURES.setdefault(size_fn, (ctypes.c_size_t, []))
    _MIRRORED_SIZES.append((name, size_bytes, size_fn))


def _check_struct_sizes(lib: ctypes.CDLL) -> None:
    for name, size_bytes, size_fn in _MIRRORED_SIZES:
        c_size = int(getattr(lib, size_fn)())
        if c_size != size_bytes:
            raise LibraryNotFoundError(
                f"{name} is {size_bytes} bytes here, {c_size} in libcolibri: the build is stale, "
                "run `pip install -e .` again")
