"""Byte sizes as people write them in a config or on a command line ("6G", "512M", "40%")
and as logs and status show them ("1.5 GiB").

A leaf module (standard library only), so that the engine, the daemon and the tools share
one reading of a size without importing each other. A percentage is of a number of bytes
the caller hands in: what that is (the memory budget) is the daemon's business
(colibrid.system.memory.parse_size measures it).
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_PERCENT_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def is_percentage(value: int | str) -> bool:
    return isinstance(value, str) and _PERCENT_RE.match(value) is not None


def size_in_bytes(value: int | str, what: str = "size", available_bytes: int | None = None) -> int:
    """Bytes from 123, "512M", "6G", "6GiB", "1.5T" (binary units) or "40%" (of
    ``available_bytes``, which a percentage needs). Raises ValueError with the accepted forms."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a size such as \"6G\" or \"40%\", got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what} must not be negative, got {value}")
        return value
    text = str(value)
    percent = _PERCENT_RE.match(text)
    if percent:
        fraction = float(percent.group(1)) / 100.0
        if not 0 < fraction <= 1:
            raise ValueError(f"{what} {text!r}: a percentage must be in (0, 100]")
        if available_bytes is None:
            raise ValueError(f"{what} {text!r}: a percentage needs the bytes it is a percentage of")
        return int(available_bytes * fraction)
    size = _SIZE_RE.match(text)
    if not size:
        raise ValueError(f"{what} {text!r} is not a size: use bytes (123), K/M/G/T (\"512M\", \"6G\") or \"40%\"")
    return int(float(size.group(1)) * _UNITS[size.group(2).lower()])


def format_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
