"""A thread's I/O priority (colibri.h, col_io_priority_*): the daemon's verify reads at IDLE
so the expert loads of the requests it serves go first."""

from __future__ import annotations

import ctypes
import enum

from colibrid.native.library import _SIGNATURES, _lib, check


class IoClass(enum.IntEnum):
    """enum col_io_class: the kernel's I/O scheduling classes."""

    NONE = 0
    REALTIME = 1
    BEST_EFFORT = 2
    IDLE = 3


_i32_p, _int_p = ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int)
_SIGNATURES.update({
    "col_io_priority_set": (ctypes.c_int, [ctypes.c_int, ctypes.c_int, _i32_p]),
    # (thread id (0: this thread), class out, level out, err out)
    "col_io_priority_get": (ctypes.c_int, [ctypes.c_int32, _int_p, _int_p, _i32_p]),
})


def set_io_priority(io_class: IoClass, level: int = 0) -> None:
    """Set the calling thread's I/O class and level (0..7); threads it starts later inherit
    them. SystemResourceError (with the errno) when the kernel refuses."""
    err = ctypes.c_int32(0)
    status = _lib().col_io_priority_set(int(io_class), int(level), ctypes.byref(err))
    check(status, f"ioprio_set({IoClass(io_class).name}, {level})", err.value)


def get_io_priority(thread_id: int = 0) -> tuple[IoClass, int]:
    """(class, level) of thread ``thread_id`` (a Linux tid; 0: the calling thread)."""
    io_class, level, err = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int32(0)
    status = _lib().col_io_priority_get(int(thread_id), ctypes.byref(io_class), ctypes.byref(level), ctypes.byref(err))
    check(status, f"ioprio_get(thread {thread_id})", err.value)
    return IoClass(io_class.value), level.value
