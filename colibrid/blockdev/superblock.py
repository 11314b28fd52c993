"""The Colibri superblock: the first bytes of a device that holds a pack's experts region.

    offset  bytes  field
         0     16  magic, b"colibri-experts\\0"
        16      4  superblock version (u32), 1
        20      4  logical block size of the device when written (u32): 512 or 4096 (power of two)
        24     16  pack id: a random UUID, also in the pack's manifest (experts.device.pack_id)
        40      8  first LBA of the experts region (u64), in logical blocks
        48      8  LBAs of the experts region (u64)
        56      8  bytes of the experts region (u64) = the manifest's experts.size
        64     60  reserved, zero
       124      4  CRC-32C of bytes 0..124 (u32)

All integers little-endian. The superblock is written last, after every record, so a device
whose conversion was interrupted carries none. It lives in the first block the region leaves
free (the region starts at the pack's alignment, 4096 bytes or more, from the device's start).
docs/format.md ("Experts on a raw block device") is the specification.
"""

from __future__ import annotations

import struct
import uuid
from dataclasses import dataclass

MAGIC = b"colibri-experts\0"
VERSION = 1
SUPERBLOCK_BYTES = 128  # what is checksummed and parsed
SUPERBLOCK_BLOCK_BYTES = 4096  # what is read and written: one page, a multiple of any logical block size
_LAYOUT = struct.Struct("<16sII16sQQQ60s")  # everything before the checksum
_CRC = struct.Struct("<I")
assert _LAYOUT.size + _CRC.size == SUPERBLOCK_BYTES
LOGICAL_BLOCK_SIZES = tuple(1 << n for n in range(9, 17))  # 512 .. 64 KiB: what Linux reports


class SuperblockError(ValueError):
    """The bytes are not a valid Colibri superblock; the message says which check failed."""


def crc32c(data: bytes, crc: int = 0) -> int:
    """CRC-32C (Castagnoli, the checksum of every record in a pack), bit by bit: the probe that
    udev runs must not load libcolibri, and 124 bytes cost nothing."""
    crc ^= 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


@dataclass(frozen=True)
class Superblock:
    pack_id: uuid.UUID
    logical_block_bytes: int
    region_first_lba: int
    region_lbas: int
    region_bytes: int

    @property
    def region_offset_bytes(self) -> int:
        """Where the experts region starts, in bytes from the device's start."""
        return self.region_first_lba * self.logical_block_bytes

    @property
    def end_bytes(self) -> int:
        """The first byte after the region: the device must have at least this many."""
        return (self.region_first_lba + self.region_lbas) * self.logical_block_bytes

    def encode(self) -> bytes:
        """The SUPERBLOCK_BLOCK_BYTES bytes to write at the device's start."""
        head = _LAYOUT.pack(MAGIC, VERSION, self.logical_block_bytes, self.pack_id.bytes, self.region_first_lba,
                            self.region_lbas, self.region_bytes, bytes(60))
        return (head + _CRC.pack(crc32c(head))).ljust(SUPERBLOCK_BLOCK_BYTES, b"\0")

    @classmethod
    def decode(cls, data: bytes) -> "Superblock":
        """Parse and check the first SUPERBLOCK_BYTES of ``data`` (hostile: from any device)."""
        if len(data) < SUPERBLOCK_BYTES:
            raise SuperblockError(f"{len(data)} bytes, a superblock has {SUPERBLOCK_BYTES}")
        if data[:len(MAGIC)] != MAGIC:
            raise SuperblockError("no Colibri superblock (magic not found)")
        head = bytes(data[:_LAYOUT.size])
        (stored_crc,) = _CRC.unpack_from(data, _LAYOUT.size)
        if crc32c(head) != stored_crc:
            raise SuperblockError(f"superblock checksum mismatch (crc32c {crc32c(head):#010x}, stored {stored_crc:#010x})")
        _, version, block, pack_id, first_lba, lbas, region_bytes, reserved = _LAYOUT.unpack(head)
        if version != VERSION:
            raise SuperblockError(f"superblock version {version} is not one this Colibri reads ({VERSION})")
        if block not in LOGICAL_BLOCK_SIZES:
            raise SuperblockError(f"logical block size {block} is not a power of two in [512, 65536]")
        if reserved != bytes(len(reserved)):
            raise SuperblockError("reserved superblock bytes are not zero")
        if first_lba * block < SUPERBLOCK_BYTES or lbas * block != -(-region_bytes // block) * block:
            raise SuperblockError(f"experts region of {lbas} LBAs at LBA {first_lba} does not hold {region_bytes} "
                                  "bytes after the superblock")
        if (first_lba + lbas) * block > 1 << 60:
            raise SuperblockError("experts region ends past 1 EiB")
        return cls(uuid.UUID(bytes=pack_id), block, first_lba, lbas, region_bytes)
