"""Frames (docs/protocol.md, Framing): a 4-byte big-endian length N, then N bytes of one msgpack map.

Both directions use the same frame, but each end checks what it reads by its own rules. The
daemon reads requests: a length above its max_frame_bytes, or a body that is not one map with
string keys, is a ProtocolError it answers with `bad_frame` or `frame_too_large`. A client reads
events: it accepts larger frames than it sends (a `done` repeats the whole text) and any map
keys a newer daemon might nest, and refuses the rest with a ProtocolViolation.

Pure: no sockets. The length is checked from the prefix alone, before a byte of the body is read.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from colibrid.wire.errors import ProtocolError, ProtocolViolation

PROTOCOL_VERSION = 1
LENGTH_PREFIX = struct.Struct(">I")  # N, the body length in bytes

# What a client accepts from the daemon before its hello tells it the daemon's own limit. That
# limit bounds what the daemon accepts; a done event repeats the whole generated text, so replies
# may be larger than requests. 64 MiB still stops a garbage length from allocating gigabytes.
MAX_EVENT_FRAME_BYTES = 64 * 1024 * 1024


def encode_frame(message: dict[str, Any]) -> bytes:
    """The bytes of one frame: length prefix + the msgpack map."""
    body = msgpack.packb(message, use_bin_type=True)
    return LENGTH_PREFIX.pack(len(body)) + body


def _unpack_one(body: bytes) -> Any:
    """The one msgpack value `body` holds; msgpack's own exception (several unrelated types) if not."""
    # strict_map_key=False: keys of any type are read here, and each end decides what it allows.
    return msgpack.unpackb(body, raw=False, strict_map_key=False)


# --------------------------------------------------------------------------------------------
# The daemon reading a client's requests
# --------------------------------------------------------------------------------------------


def request_body_length(prefix: bytes, max_frame_bytes: int) -> int:
    """The body length announced by a 4-byte prefix; checked before a byte of the body is read."""
    (length,) = LENGTH_PREFIX.unpack(prefix)
    if length == 0:
        raise ProtocolError("bad_frame", "zero-length frame: a frame holds one msgpack map")
    if length > max_frame_bytes:
        raise ProtocolError("frame_too_large", f"frame of {length} bytes is above max_frame_bytes ({max_frame_bytes})")
    return length


def decode_request_body(body: bytes) -> dict[str, Any]:
    """The one msgpack map with string keys that `body` must hold."""
    try:
        message = _unpack_one(body)
    except Exception as exc:  # msgpack raises several unrelated types for malformed input
        raise ProtocolError("bad_frame", f"frame body is not one msgpack object ({type(exc).__name__})") from None
    if not isinstance(message, dict) or not all(isinstance(key, str) for key in message):
        raise ProtocolError("bad_frame", "frame body must be a msgpack map with string keys")
    return message


# --------------------------------------------------------------------------------------------
# A client reading the daemon's events
# --------------------------------------------------------------------------------------------


def event_body_length(prefix: bytes, max_frame_bytes: int = MAX_EVENT_FRAME_BYTES) -> int:
    """The body length announced by a 4-byte prefix from the daemon; ProtocolViolation for 0 or
    above max_frame_bytes."""
    (length,) = LENGTH_PREFIX.unpack(prefix)
    if length == 0 or length > max_frame_bytes:
        raise ProtocolViolation(f"the daemon sent a frame length of {length} bytes "
                                f"(allowed: 1 to {max_frame_bytes})")
    return length


def decode_event_body(body: bytes) -> dict[Any, Any]:
    """One frame's body from the daemon -> the map it holds; anything else is a ProtocolViolation.
    Keys of any type are accepted (be liberal in what we read): event_from_wire checks the fields."""
    try:
        message = _unpack_one(body)
    except Exception as error:  # malformed input raises several unrelated msgpack types
        raise ProtocolViolation(f"the daemon sent a frame that is not one msgpack value "
                                f"({type(error).__name__}: {error})") from None
    if not isinstance(message, dict):
        raise ProtocolViolation(f"the daemon sent a {type(message).__name__}, not a map")
    return message
