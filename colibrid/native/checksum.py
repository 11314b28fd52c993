"""CRC-32C (Castagnoli), the checksum of every expert record in a pack."""

from __future__ import annotations

import numpy as np

from colibrid.native.arguments import _byte_view, _ptr
from colibrid.native.errors import InvalidArgumentError
from colibrid.native.library import _lib


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
