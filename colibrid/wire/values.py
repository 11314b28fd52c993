"""The kinds of msgpack value both directions check: an integer and a number, never a boolean
(msgpack and Python both let True pass for 1, which no field of the protocol means)."""

from __future__ import annotations

from typing import Any


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
