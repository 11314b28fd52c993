"""Where a pack's expert records are read from: ``experts.bin`` in the pack directory, or the
experts region of a raw block device (after its superblock, docs/format.md).

Everything that reads records - the plain pread source, libcolibri's loader under the expert
cache, tools - goes through an ExpertsRegion: ``open()`` gives a fresh read-only descriptor,
``loader()`` a libcolibri loader, and ``device_offset(record)`` where a record starts on what
they read. A device is found again by its superblock at every ``open`` (so one that went away
and came back under another name is found), never trusted by its name.
"""

from __future__ import annotations

import os
from pathlib import Path

from colibrid import native
from colibrid.blockdev.locate import DEV_ROOT, DeviceNotFound, FoundDevice, find_pack_device
from colibrid.blockdev.sysfs import SYSFS_ROOT
from colibrid.pack.manifest import EXPERTS_FILE, ExpertRecord, ExpertsDevice, Manifest, PackError


class ExpertsRegion:
    """The records of a pack in ``experts.bin``."""

    def __init__(self, path: Path, size_bytes: int) -> None:
        self.path = path  # what reads name in messages; thermal discovery starts from it
        self.size_bytes = size_bytes
        self.base_offset = 0  # bytes before record offset 0 in what open() reads

    @property
    def on_device(self) -> bool:
        return False

    def describe(self) -> str:
        return str(self.path)

    def where(self, offset: int) -> str:
        """Names record offset ``offset`` for an error message."""
        return f"offset {offset} of {self.path}"

    def device_offset(self, record: ExpertRecord) -> int:
        """Where ``record`` starts in what open() and loader() read."""
        return self.base_offset + record.offset

    def open(self) -> int:
        """A new read-only descriptor of the records (the caller closes it)."""
        return os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)

    def loader(self, queue_depth: int, max_queue_depth: int, direct: native.AepcMode) -> native.Loader:
        """libcolibri's loader on the records (O_DIRECT as ``direct`` says)."""
        return native.Loader(self.path, queue_depth=queue_depth, max_queue_depth=max_queue_depth, direct=direct)

    def check(self) -> None:
        """PackError unless the records are there, with the size the manifest says."""
        if not self.path.is_file():
            raise PackError(f"pack {self.path.parent} is incomplete: {EXPERTS_FILE} is missing")
        actual = self.path.stat().st_size
        if actual != self.size_bytes:
            raise PackError(f"pack {self.path.parent} is damaged: {EXPERTS_FILE} has {actual} bytes, "
                            f"manifest says {self.size_bytes}")


class DeviceExpertsRegion(ExpertsRegion):
    """The records of a pack on a raw block device, ``record`` at region_offset + its offset."""

    def __init__(self, pack_dir: Path, record: ExpertsDevice, size_bytes: int,
                 sysfs_root: Path = SYSFS_ROOT, dev_root: Path = DEV_ROOT) -> None:
        super().__init__(dev_root / str(record.identity.get("name", "?")), size_bytes)
        self.pack_dir = pack_dir
        self.record = record
        self.base_offset = record.region_offset
        self._sysfs_root, self._dev_root = sysfs_root, dev_root
        self._identity = dict(record.identity)
        self.logical_block_bytes = record.logical_block_size

    @property
    def on_device(self) -> bool:
        return True

    def describe(self) -> str:
        return f"{self.path} (pack id {self.record.pack_id})"

    def where(self, offset: int) -> str:
        byte = self.base_offset + offset
        return f"LBA {byte // self.logical_block_bytes} (byte {byte}) of {self.path}"

    def _find(self) -> FoundDevice:
        """The device, found by its superblock and checked against the manifest."""
        try:
            found = find_pack_device(self.record.pack_id, self._identity, self.base_offset + self.size_bytes,
                                     self._sysfs_root, self._dev_root)
        except DeviceNotFound as exc:
            raise PackError(f"pack {self.pack_dir} keeps its experts on a raw block device: {exc}") from None
        try:
            self._check_superblock(found)
        except PackError:
            found.close()
            raise
        # Look there first next time, and name it in messages and to the thermal watch.
        self.path, self._identity["name"] = found.node, found.device.name
        self.logical_block_bytes = found.device.logical_block_bytes
        return found

    def _check_superblock(self, found: FoundDevice) -> None:
        sb, device = found.superblock, found.device
        problems = []
        if sb.region_offset_bytes != self.base_offset:
            problems.append(f"its region starts at byte {sb.region_offset_bytes}, the manifest says {self.base_offset}")
        if sb.region_bytes != self.size_bytes:
            problems.append(f"its region holds {sb.region_bytes} bytes, the manifest's experts.size is {self.size_bytes}")
        if self.base_offset % device.logical_block_bytes:
            problems.append(f"its logical block size is now {device.logical_block_bytes}, which does not divide the "
                            f"region's start {self.base_offset}")
        if problems:
            raise PackError(f"pack {self.pack_dir}: {found.node} carries pack id {sb.pack_id}, but "
                            f"{'; '.join(problems)}: convert the checkpoint again")

    def open(self) -> int:
        found = self._find()
        return found.fd

    def loader(self, queue_depth: int, max_queue_depth: int, direct: native.AepcMode) -> native.Loader:
        fd = self.open()
        try:
            return native.Loader(self.path, queue_depth=queue_depth, max_queue_depth=max_queue_depth, direct=direct,
                                 fd=fd)
        finally:
            os.close(fd)

    def check(self) -> None:
        os.close(self.open())


def experts_region(pack_dir: Path, manifest: Manifest) -> ExpertsRegion:
    """The region a pack's manifest describes."""
    if manifest.experts_device is None:
        return ExpertsRegion(pack_dir / EXPERTS_FILE, manifest.experts_size)
    return DeviceExpertsRegion(pack_dir, manifest.experts_device, manifest.experts_size)
