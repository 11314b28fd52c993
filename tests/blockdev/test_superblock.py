"""The superblock at the start of a device that holds a pack's experts region: what is written
reads back, and every damaged or foreign superblock is refused with the reason."""

from __future__ import annotations

import os
import struct
import uuid

import pytest

from colibrid.blockdev.superblock import (MAGIC, SUPERBLOCK_BLOCK_BYTES, SUPERBLOCK_BYTES, Superblock, SuperblockError,
                                          crc32c)

PACK_ID = uuid.UUID("6f1c2b9a-4d3e-4f5a-9b8c-7d6e5f4a3b2c")


def _superblock(**changes) -> Superblock:
    fields = dict(pack_id=PACK_ID, logical_block_bytes=512, region_first_lba=8, region_lbas=2048,
                  region_bytes=2048 * 512)
    return Superblock(**{**fields, **changes})


def _resealed(data: bytearray) -> bytes:
    """``data`` with its checksum recomputed: a well-formed superblock saying something wrong."""
    data[124:128] = struct.pack("<I", crc32c(bytes(data[:124])))
    return bytes(data)


def test_the_pure_python_crc32c_is_the_packs_crc32c():
    from colibrid import native

    assert crc32c(b"123456789") == 0xE3069283  # the check value docs/format.md gives
    data = os.urandom(300)
    assert crc32c(data) == native.crc32c(data)


def test_a_superblock_reads_back_as_written():
    written = _superblock(logical_block_bytes=4096, region_first_lba=1, region_lbas=3, region_bytes=3 * 4096)
    data = written.encode()
    assert len(data) == SUPERBLOCK_BLOCK_BYTES and data[:16] == MAGIC and data[SUPERBLOCK_BYTES:] == bytes(
        SUPERBLOCK_BLOCK_BYTES - SUPERBLOCK_BYTES)
    read = Superblock.decode(data)
    assert read == written
    assert (read.region_offset_bytes, read.end_bytes) == (4096, 4 * 4096)


def test_the_layout_is_the_documented_one():
    data = _superblock().encode()
    assert struct.unpack_from("<II", data, 16) == (1, 512)
    assert data[24:40] == PACK_ID.bytes
    assert struct.unpack_from("<QQQ", data, 40) == (8, 2048, 2048 * 512)
    assert data[64:124] == bytes(60)
    assert struct.unpack_from("<I", data, 124)[0] == crc32c(data[:124])


@pytest.mark.parametrize("what, damage, reason", [
    ("no magic", lambda d: bytearray(b"\0" * 16) + d[16:], "magic not found"),
    ("a flipped bit", lambda d: d[:30] + bytearray([d[30] ^ 1]) + d[31:], "checksum mismatch"),
    ("a future version", lambda d: _resealed(d[:16] + bytearray(struct.pack("<I", 2)) + d[20:]), "version 2"),
    ("a block size that is not a power of two", lambda d: _resealed(d[:20] + bytearray(struct.pack("<I", 1000)) + d[24:]),
     "logical block size 1000"),
    ("reserved bytes set", lambda d: _resealed(d[:64] + bytearray(b"x") + d[65:]), "reserved"),
    ("a region that overlaps the superblock", lambda d: _resealed(d[:40] + bytearray(struct.pack("<Q", 0)) + d[48:]),
     "does not hold"),
    ("a region too short for its bytes", lambda d: _resealed(d[:48] + bytearray(struct.pack("<Q", 1)) + d[56:]),
     "does not hold"),
    ("too few bytes", lambda d: d[:100], "a superblock has 128"),
])
def test_a_damaged_or_foreign_superblock_is_refused(what, damage, reason):
    with pytest.raises(SuperblockError, match=reason):
        Superblock.decode(bytes(damage(bytearray(_superblock().encode()))))
