"""The exceptions a libcolibri status becomes: one ColibriError subclass per status code
of colibri.h's enum col_status (and LibraryNotFoundError, when there is no usable library)."""

from __future__ import annotations


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


for _cls in (ReadError, ChecksumError, NoFreeSlotError, SystemResourceError):
    _ERROR_BY_STATUS[_cls.status] = _cls
