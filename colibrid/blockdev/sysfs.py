"""What sysfs says about a block device: its size, its logical block size, whether it is a
partition and of which disk, its partitions, what holds it (dm, md), what a loop device is
backed by, and the attributes that identify it across reboots (wwid, serial, model).

A device is always looked up by its device number (MAJ:MIN, from fstat of an open descriptor:
st_rdev), never by a name someone passed: <sysfs>/dev/block/MAJ:MIN is the kernel's own map.
Every function takes a ``sysfs_root`` so the tests can run against a fake tree.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

SYSFS_ROOT = Path("/sys")
SECTOR_BYTES = 512  # <sysfs>/class/block/X/size counts 512-byte sectors whatever the device's block size
_MAX_STACK_DEPTH = 8  # dm over md over partitions ...: followed this deep
_MAX_ATTRIBUTE_BYTES = 4096


def read_attribute(directory: Path, name: str) -> str | None:
    """A small sysfs attribute, stripped (sysfs pads model and serial with spaces); None if absent."""
    try:
        with open(directory / name, "rb") as f:
            return f.read(_MAX_ATTRIBUTE_BYTES).decode("utf-8", "replace").strip()
    except OSError:
        return None


def _int_attribute(directory: Path, name: str) -> int | None:
    text = read_attribute(directory, name)
    return int(text) if text is not None and text.isdigit() else None


@dataclass(frozen=True)
class BlockDevice:
    """One block device (a disk, a partition, a loop, dm or md device) as sysfs shows it now."""

    name: str  # "nvme0n1p3", "loop4", "dm-0"
    sys_dir: Path  # its resolved sysfs directory
    dev: str  # "259:3"
    size_bytes: int
    logical_block_bytes: int  # of the queue it is on (a partition's disk's)
    partition_number: int | None  # None: a whole disk (or a loop, dm, md device)
    disk_name: str  # the whole disk it is part of: itself when not a partition
    disk_dir: Path
    read_only: bool

    @property
    def is_partition(self) -> bool:
        return self.partition_number is not None

    @property
    def node(self) -> str:
        return f"/dev/{self.name}"

    def partitions(self) -> list[str]:
        """The partitions of this whole disk, by name (none for a partition)."""
        if self.is_partition:
            return []
        return sorted(entry.name for entry in self.sys_dir.iterdir() if (entry / "partition").is_file())

    def holders(self) -> list[str]:
        """The devices built on this one (dm-crypt, LVM, md RAID): it is in use while any exists."""
        try:
            return sorted(os.listdir(self.sys_dir / "holders"))
        except OSError:
            return []

    def slaves(self) -> list[Path]:
        """The devices this one is built on (dm, md), resolved."""
        try:
            return [(self.sys_dir / "slaves" / name).resolve() for name in sorted(os.listdir(self.sys_dir / "slaves"))]
        except OSError:
            return []

    def loop_backing_file(self) -> str | None:
        """The file a loop device reads (as the kernel recorded its path), else None."""
        return read_attribute(self.sys_dir / "loop", "backing_file")

    def identity(self) -> dict[str, str | int]:
        """What names this device across reboots and renumbering: for the manifest's record,
        used to look there first and to tell the user which device to attach. Never trusted:
        the superblock decides."""
        found: dict[str, str | int] = {"name": self.name, "size_bytes": self.size_bytes}
        if self.partition_number is not None:
            found["partition"] = self.partition_number
        for key, directory, attribute in (("wwid", self.disk_dir, "wwid"), ("wwid", self.disk_dir / "device", "wwid"),
                                          ("serial", self.disk_dir / "device", "serial"),
                                          ("serial", self.disk_dir, "serial"),
                                          ("model", self.disk_dir / "device", "model")):
            value = read_attribute(directory, attribute)
            if value and key not in found:
                found[key] = value[:200]
        backing = self.loop_backing_file()
        if backing:
            found["loop_backing_file"] = backing[:4096]
        return found


def block_dir_of(dev: str, sysfs_root: Path = SYSFS_ROOT) -> Path | None:
    """The sysfs directory of device number ``dev`` ("7:3"), or None if there is no such device."""
    link = sysfs_root / "dev" / "block" / dev
    return link.resolve() if link.exists() else None


def device_from_dir(sys_dir: Path) -> BlockDevice | None:
    """The BlockDevice of a resolved sysfs directory; None if it is not one (or vanished)."""
    dev = read_attribute(sys_dir, "dev")
    sectors = _int_attribute(sys_dir, "size")
    if dev is None or sectors is None:
        return None
    partition = _int_attribute(sys_dir, "partition")
    disk_dir = sys_dir.parent if partition is not None else sys_dir
    block = _int_attribute(disk_dir / "queue", "logical_block_size") or SECTOR_BYTES
    return BlockDevice(name=sys_dir.name, sys_dir=sys_dir, dev=dev, size_bytes=sectors * SECTOR_BYTES,
                       logical_block_bytes=block, partition_number=partition, disk_name=disk_dir.name,
                       disk_dir=disk_dir, read_only=read_attribute(sys_dir, "ro") == "1")


def device_of_number(rdev: int, sysfs_root: Path = SYSFS_ROOT) -> BlockDevice | None:
    """The BlockDevice whose device number is ``rdev`` (an st_rdev), or None."""
    sys_dir = block_dir_of(f"{os.major(rdev)}:{os.minor(rdev)}", sysfs_root)
    return device_from_dir(sys_dir) if sys_dir is not None else None


def all_devices(sysfs_root: Path = SYSFS_ROOT) -> list[BlockDevice]:
    """Every block device sysfs lists now, by name."""
    try:
        names = sorted(os.listdir(sysfs_root / "class" / "block"))
    except OSError:
        return []
    found = []
    for name in names:
        device = device_from_dir((sysfs_root / "class" / "block" / name).resolve())
        if device is not None:
            found.append(device)
    return found


def disks_under(device: BlockDevice, sysfs_root: Path = SYSFS_ROOT, depth: int = 0) -> set[str]:
    """The whole disks a device lives on: its own disk, or (dm, md) those of what it is built
    on, recursively; a loop device is its own disk (its file is on some other device)."""
    slaves = device.slaves()
    if not slaves or depth >= _MAX_STACK_DEPTH:
        return {device.disk_name}
    disks: set[str] = set()
    for slave_dir in slaves:
        slave = device_from_dir(slave_dir)
        if slave is not None:
            disks |= disks_under(slave, sysfs_root, depth + 1)
    return disks
