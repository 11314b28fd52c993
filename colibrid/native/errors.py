"""The exceptions a libcolibri status becomes: one ColibriError subclass per status code
of colibri.h's enum col_status (and LibraryNotFoundError, when there is no usable library).
library.status_error builds them, with col_status_string's text."""

from __future__ import annotations

import enum


class Status(enum.IntEnum):
    """enum col_status (colibri.h): what every libcolibri function that can fail returns."""

    OK = 0
    EINVAL = 1
    ENOMEM = 2
    ERANGE = 3
    ENOTSUP = 4
    EIO = 5
    ECHECKSUM = 6
    EBUSY = 7
    ESYSTEM = 8


class ColibriError(Exception):
    """A libcolibri call failed; ``status`` is the C status code (see colibri.h)."""

    status = -1

    def __init__(self, message: str | None = None, status: int | None = None):
        if status is not None:
            self.status = status
        super().__init__(message or f"libcolibri: status {self.status}")


class InvalidArgumentError(ColibriError, ValueError):
    """COL_EINVAL: bad type, size, shape or buffer; nothing was written."""

    status = Status.EINVAL


class OutOfMemoryError(ColibriError, MemoryError):
    """COL_ENOMEM: an allocation inside libcolibri failed; nothing was written."""

    status = Status.ENOMEM


class ValueRangeError(ColibriError, ValueError):
    """COL_ERANGE: a value cannot be represented (NaN/inf or too large for a quantized type)."""

    status = Status.ERANGE


class NotSupportedError(ColibriError):
    """COL_ENOTSUP: not supported for this type or on this machine."""

    status = Status.ENOTSUP


class ReadError(ColibriError, OSError):
    """COL_EIO: a read failed or came back short (or the experts file cannot be opened)."""

    status = Status.EIO


class ChecksumError(ColibriError):
    """COL_ECHECKSUM: a record's bytes do not match its crc32c."""

    status = Status.ECHECKSUM


class NoFreeSlotError(ColibriError):
    """COL_EBUSY: every slot of the cache is pinned or loading."""

    status = Status.EBUSY


class SystemResourceError(ColibriError):
    """COL_ESYSTEM: the OS refused a required resource (mlock, hugetlb pages, O_DIRECT,
    a thread). ``info`` holds the object's info struct as a dict, when there is one."""

    status = Status.ESYSTEM
    info: dict | None = None


class LibraryNotFoundError(ColibriError, ImportError):
    """libcolibri is not built, is stale, or COLIBRI_LIBRARY points at nothing usable."""


# status code -> the exception it becomes; codes not listed (none today) raise ColibriError
_ERROR_BY_STATUS: dict[int, type[ColibriError]] = {
    cls.status: cls
    for cls in (InvalidArgumentError, OutOfMemoryError, ValueRangeError, NotSupportedError, ReadError, ChecksumError,
                NoFreeSlotError, SystemResourceError)
}
