"""colibrid.wire.frames: a frame is a big-endian length and one msgpack map, and each end refuses
what docs/protocol.md says it must (the daemon with an error code, a client with a ProtocolViolation)."""

from __future__ import annotations

import struct

import msgpack
import pytest

from colibrid.wire.errors import ProtocolError, ProtocolViolation
from colibrid.wire.frames import (
    MAX_EVENT_FRAME_BYTES, decode_event_body, decode_request_body, encode_frame, event_body_length,
    request_body_length,
)

def test_a_frame_is_a_big_endian_length_and_one_msgpack_map():
    frame = encode_frame({"event": "ok", "id": 1})
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    assert decode_request_body(frame[4:]) == {"event": "ok", "id": 1}


@pytest.mark.parametrize("length, code", [(0, "bad_frame"), (1025, "frame_too_large"), ((1 << 32) - 1, "frame_too_large")])
def test_length_prefix_limits(length, code):
    with pytest.raises(ProtocolError) as caught:
        request_body_length(struct.pack(">I", length), max_frame_bytes=1024)
    assert caught.value.code == code and caught.value.closes_connection


def test_the_largest_allowed_frame_passes():
    assert request_body_length(struct.pack(">I", 1024), max_frame_bytes=1024) == 1024


@pytest.mark.parametrize("body", [b"\xc1", msgpack.packb("a string"), msgpack.packb({b"k": 1}),
                                  msgpack.packb({}) + msgpack.packb({}), b"\xa5ab"])
def test_bodies_that_are_not_one_map_with_string_keys(body):
    with pytest.raises(ProtocolError) as caught:
        decode_request_body(body)
    assert caught.value.code == "bad_frame"


# ---- a client reading the daemon's frames ----------------------------------------------------


@pytest.mark.parametrize("length", [0, MAX_EVENT_FRAME_BYTES + 1])
def test_a_client_refuses_a_length_of_zero_or_above_its_limit(length):
    with pytest.raises(ProtocolViolation, match=f"frame length of {length} bytes"):
        event_body_length(struct.pack(">I", length))


def test_a_client_accepts_frames_larger_than_a_daemon_takes():
    # A done event repeats the whole text: replies may be far larger than max_frame_bytes.
    assert event_body_length(struct.pack(">I", 32 << 20)) == 32 << 20
    assert event_body_length(struct.pack(">I", 100), max_frame_bytes=100) == 100


@pytest.mark.parametrize("body, says", [(b"\xc1", "not one msgpack value"), (msgpack.packb([1, 2]), "a list, not a map"),
                                        (msgpack.packb({}) + msgpack.packb({}), "not one msgpack value")])
def test_a_client_refuses_a_body_that_is_not_one_map(body, says):
    with pytest.raises(ProtocolViolation, match=says):
        decode_event_body(body)


def test_a_client_reads_maps_with_keys_of_any_type():
    # Be liberal in what we read: a newer daemon may nest maps keyed by integers.
    assert decode_event_body(msgpack.packb({"event": "status", "id": 1, "by_layer": {3: 1}})) == \
        {"event": "status", "id": 1, "by_layer": {3: 1}}
