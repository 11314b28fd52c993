"""libcolibri's worker pool (col_pool) and the process-wide default pool every compute
call uses unless given one."""

from __future__ import annotations

import ctypes

from colibrid.native.arguments import _as_count
from colibrid.native.errors import InvalidArgumentError
from colibrid.native.library import _lib, _lib_lock, check, mirrors_c_struct


# --------------------------------------------------------------------------------------------
# Worker pool
# --------------------------------------------------------------------------------------------


@mirrors_c_struct("col_pool_params_size")
class _PoolParams(ctypes.Structure):
    """Mirror of col_pool_params (colibri.h); its size is checked against C at load."""

    _fields_ = [
        ("n_threads", ctypes.c_int32),
        ("n_cpus", ctypes.c_int32),
        ("cpus", ctypes.POINTER(ctypes.c_int32)),
        ("spin_us", ctypes.c_int32),
    ]


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
