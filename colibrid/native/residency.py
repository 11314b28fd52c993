"""How much of a buffer is resident in memory, by mincore(2): page by page, whether a page
of a mapping is in memory. A buffer that was never touched (np.empty) or was swapped out
counts only what is really there. One call for a 10 GiB buffer reads 2.6 M page flags from
the page tables: a few milliseconds, so a caller that polls keeps the answer for a moment.
(ctypes, so here: the native layer is where the product calls the C library.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

import numpy as np

_PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_libc.mincore.restype = ctypes.c_int


def resident_bytes(array: np.ndarray | None) -> int:
    """The bytes of ``array`` (one contiguous buffer) whose pages are in memory now. A partly
    covered first or last page counts whole only for the part inside the buffer. 0 for None
    or an empty buffer; -1 if mincore fails (e.g. the range is not mapped)."""
    if array is None or array.nbytes == 0:
        return 0
    start = array.__array_interface__["data"][0]
    end = start + array.nbytes
    first = start - start % _PAGE
    n_pages = (end - first + _PAGE - 1) // _PAGE
    flags = (ctypes.c_ubyte * n_pages)()
    if _libc.mincore(ctypes.c_void_p(first), ctypes.c_size_t(n_pages * _PAGE), flags) != 0:
        return -1
    resident = np.frombuffer(flags, dtype=np.uint8) & 1
    total = int(resident.sum()) * _PAGE
    # Trim the parts of the first and last page that lie outside the buffer.
    if resident[0]:
        total -= start - first
    if resident[-1]:
        total -= first + n_pages * _PAGE - end
    return max(total, 0)
