"""Write a pack's experts region straight to a raw block device.

    byte 0                   the superblock (colibrid/blockdev/superblock.py), in a block of
                             `alignment` bytes (4096 by default)
    byte `alignment`         record 0, record 1, ... exactly as they would be in experts.bin

Writes use O_DIRECT (the descriptor WritableDevice opened) from a page-aligned staging buffer,
every write a whole number of the device's logical blocks at an offset aligned to them. In
order: first the places where signatures live are zeroed - the superblock's block, the first
and the last MiB, so no stale file system, RAID member or backup GPT survives to be found by
blkid or assembled by udev - then the records, and the superblock last, then fsync (which
also flushes the drive's write cache). A conversion killed before the end leaves a device
without a valid superblock, which no manifest opens.
"""

from __future__ import annotations

import logging
import mmap
import os
import uuid

import numpy as np

from colibrid.blockdev.safety import WritableDevice
from colibrid.blockdev.superblock import SUPERBLOCK_BLOCK_BYTES, Superblock
from colibrid.pack.manifest import ExpertsDevice

log = logging.getLogger(__name__)

STAGING_BYTES = 8 << 20  # records are gathered into writes of this size
WIPE_BYTES = 1 << 20  # zeroed at the start and at the end of the device before anything else


class DeviceTooSmall(OSError):
    """More records than the device holds (its size was checked against the plan at the start)."""


class DeviceExpertsSink:
    """Appends padded expert records to the experts region of ``target``; ``finish`` writes
    the superblock and returns the manifest's device record."""

    def __init__(self, target: WritableDevice, alignment: int) -> None:
        device = target.device
        if device.logical_block_bytes > alignment or alignment % device.logical_block_bytes:
            raise ValueError(f"{target.path} has {device.logical_block_bytes}-byte logical blocks, more than "
                             f"--align {alignment}: pass --align {device.logical_block_bytes}")
        self.target = target
        self.alignment = alignment
        self.region_offset = max(alignment, SUPERBLOCK_BLOCK_BYTES)  # the superblock's block, then the records
        self.pack_id = uuid.uuid4()
        self.size = 0  # bytes of records written (or staged)
        self._staging = mmap.mmap(-1, max(STAGING_BYTES // alignment, 1) * alignment)  # page-aligned, for O_DIRECT
        self._staged = 0
        self._flushed = 0  # bytes of records on the device
        self._wipe()

    def _pwrite_all(self, view: memoryview, offset: int) -> None:
        while view:
            written = os.pwritev(self.target.fd, [view], offset)
            view, offset = view[written:], offset + written

    def _zero(self, offset: int, length: int) -> None:
        zeros = mmap.mmap(-1, length)
        try:
            self._pwrite_all(memoryview(zeros), offset)
        finally:
            zeros.close()

    def _wipe(self) -> None:
        """Zero the superblock's block and the first and last MiB (where signatures live)."""
        device_bytes = self.target.device.size_bytes
        block = self.target.device.logical_block_bytes
        head = min(max(WIPE_BYTES, self.region_offset), device_bytes)
        self._zero(0, head)
        tail_offset = max(device_bytes - WIPE_BYTES, head)
        tail_offset -= tail_offset % block
        if tail_offset < device_bytes:
            self._zero(tail_offset, device_bytes - tail_offset)

    def write(self, record: np.ndarray) -> int:
        """Append one record (uint8, a multiple of the alignment); returns its offset in the region."""
        offset = self.size
        if self.region_offset + offset + record.nbytes > self.target.device.size_bytes:
            raise DeviceTooSmall(f"{self.target.path} is full: {self.target.device.size_bytes} bytes hold no more records")
        data = memoryview(np.ascontiguousarray(record)).cast("B")
        while data:
            room = len(self._staging) - self._staged
            take = min(room, len(data))
            self._staging[self._staged:self._staged + take] = data[:take]
            self._staged += take
            data = data[take:]
            if self._staged == len(self._staging):
                self._flush()
        self.size += record.nbytes
        return offset

    def _flush(self) -> None:
        if self._staged:
            start = self.region_offset + self._flushed
            self._pwrite_all(memoryview(self._staging)[:self._staged], start)
            self._flushed += self._staged
            self._staged = 0

    def finish(self) -> ExpertsDevice:
        """Write what is staged, then the superblock, and make it all durable."""
        self._flush()
        block = self.target.device.logical_block_bytes
        superblock = Superblock(self.pack_id, block, self.region_offset // block,
                                -(-self.size // block), self.size)
        head = mmap.mmap(-1, self.region_offset)
        try:
            head[:SUPERBLOCK_BLOCK_BYTES] = superblock.encode()
            self._pwrite_all(memoryview(head), 0)
        finally:
            head.close()
        os.fsync(self.target.fd)
        log.info("wrote %d bytes of expert records to %s after its superblock (pack id %s)", self.size,
                 self.target.path, self.pack_id)
        return ExpertsDevice(str(self.pack_id), self.region_offset, block, self.target.device.identity())

    def close(self) -> None:
        self._staging.close()
