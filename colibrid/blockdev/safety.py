"""The rules that keep colibri-convert --device from overwriting what it must not.

Each refusal is a DeviceRefused whose message says why, and how to override it where an
override makes sense:

    not a block device                           (fstat of the opened descriptor)
    in use: mounted, swap, or claimed             the kernel's exclusive open (O_EXCL) refuses,
                                                 and /proc/self/mountinfo, /proc/swaps and
                                                 <sysfs>/holders are checked too (dm, md, LVM)
    on the disk that holds / or /boot             never, whatever the flags
    read-only                                     never
    smaller than the experts region               never
    a whole disk with a partition table           unless --whole-disk
    a file system, swap, RAID, LVM, LUKS          unless --force-overwrite
    another pack's experts region                 unless --force (replace it) or --force-overwrite

The device is named by the user, so the path is resolved, then opened, and every check after
that looks at the opened descriptor's device number (st_rdev), never at the name again.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from colibrid.blockdev import signatures as sig
from colibrid.blockdev.sysfs import (SECTOR_BYTES, SYSFS_ROOT, BlockDevice, device_from_dir, device_of_number, disks_under,
                                     read_attribute)

log = logging.getLogger(__name__)

MOUNTINFO = Path("/proc/self/mountinfo")
SWAPS = Path("/proc/swaps")
SYSTEM_MOUNTS = ("/", "/boot", "/boot/efi")  # the disks under these are never written


class DeviceRefused(Exception):
    """colibri-convert will not write to this device; the message says why and what to do."""


@dataclass(frozen=True)
class WriteOptions:
    force_overwrite: bool = False  # --force-overwrite: destroy what the device holds
    whole_disk: bool = False  # --whole-disk: a whole disk with a partition table is allowed
    replace_pack: bool = False  # --force: another pack's experts region may be replaced


@dataclass
class WritableDevice:
    """A block device opened for writing (O_RDWR | O_EXCL | O_DIRECT) that passed every rule;
    the exclusive open keeps it from being mounted or claimed until close()."""

    fd: int
    path: str  # as resolved from what the user gave
    device: BlockDevice
    overwritten: list[sig.Signature] = field(default_factory=list)  # what --force-overwrite destroys

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_for_writing(path: str | os.PathLike, needed_bytes: int, options: WriteOptions,
                     sysfs_root: Path = SYSFS_ROOT, mountinfo: Path = MOUNTINFO, swaps: Path = SWAPS) -> WritableDevice:
    """Open ``path`` exclusively and check it against every rule; ``needed_bytes`` is the
    superblock's block plus the experts region. DeviceRefused names the first rule broken."""
    resolved = os.path.realpath(path)
    fd = _open_exclusive(path, resolved)
    try:
        device = _checked_device(fd, path, resolved, sysfs_root)
        _check_not_in_use(device, sysfs_root, mountinfo, swaps)
        _check_not_system_disk(device, sysfs_root, mountinfo)
        if device.size_bytes < needed_bytes:
            raise DeviceRefused(f"{resolved} has {device.size_bytes} bytes ({device.size_bytes / 2**20:.1f} MiB); the "
                                f"experts region and its superblock need {needed_bytes} ({needed_bytes / 2**20:.1f} MiB): "
                                "choose a larger partition")
        found = _signatures(fd, device, resolved)
        overwritten = _check_signatures(found, device, resolved, options)
        for partition, part_found in _partition_signatures(fd, device, sysfs_root):
            overwritten += _check_signatures(part_found, partition, f"{resolved} partition {partition.name}", options)
        return WritableDevice(fd, resolved, device, overwritten)
    except BaseException:
        os.close(fd)
        raise


def _open_exclusive(path, resolved: str) -> int:
    try:
        return os.open(resolved, os.O_RDWR | os.O_EXCL | os.O_DIRECT | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            raise DeviceRefused(f"{resolved} is in use: the kernel refused an exclusive open (it is mounted, "
                                "active swap, or claimed by device mapper, md RAID or another program); "
                                "unmount or release it first") from None
        if exc.errno == errno.ENOENT:
            raise DeviceRefused(f"{path}: no such device") from None
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise DeviceRefused(f"{resolved}: permission denied: writing a block device needs root") from None
        if exc.errno == errno.EROFS:
            raise DeviceRefused(f"{resolved} is read-only") from None
        raise DeviceRefused(f"{resolved}: cannot open it for writing: {exc.strerror}") from None


def _checked_device(fd: int, path, resolved: str, sysfs_root: Path) -> BlockDevice:
    info = os.fstat(fd)
    if not stat.S_ISBLK(info.st_mode):
        raise DeviceRefused(f"{path} is not a block device; to write the experts to a file, leave out --device")
    device = device_of_number(info.st_rdev, sysfs_root)
    if device is None:
        raise DeviceRefused(f"{resolved} (device {os.major(info.st_rdev)}:{os.minor(info.st_rdev)}) is not in sysfs")
    if device.read_only:
        raise DeviceRefused(f"{resolved} is read-only (sysfs ro = 1)")
    if device.size_bytes == 0:
        raise DeviceRefused(f"{resolved} has no media (0 bytes): an unbound loop device or an empty drive")
    return device


def mounted_devices(mountinfo: Path = MOUNTINFO) -> dict[str, str]:
    """{MAJ:MIN: mount point} of every mount in this mount namespace."""
    found = {}
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split(" - ", 1)[0].split()
        if len(fields) >= 5:
            found.setdefault(fields[2], fields[4].replace("\\040", " "))
    return found


def swap_devices(swaps: Path = SWAPS) -> set[str]:
    """MAJ:MIN of the block devices in use as swap."""
    found = set()
    try:
        lines = swaps.read_text().splitlines()[1:]
    except OSError:
        return found
    for line in lines:
        name = line.split(maxsplit=1)[0] if line.strip() else ""
        try:
            info = os.stat(name.replace("\\040", " "))
        except OSError:
            continue
        if stat.S_ISBLK(info.st_mode):
            found.add(f"{os.major(info.st_rdev)}:{os.minor(info.st_rdev)}")
    return found


def _check_not_in_use(device: BlockDevice, sysfs_root: Path, mountinfo: Path, swaps: Path) -> None:
    """Mounted, swap or held by dm/md, the device or (a whole disk) any of its partitions."""
    mounts, swap = mounted_devices(mountinfo), swap_devices(swaps)
    checked = [device] + [p for p in (device_of_partition(device, name) for name in device.partitions()) if p]
    for part in checked:
        what = part.node if part is device else f"its partition {part.node}"
        if part.dev in mounts:
            raise DeviceRefused(f"{device.node}: {what} is mounted on {mounts[part.dev]}; unmount it first")
        if part.dev in swap:
            raise DeviceRefused(f"{device.node}: {what} is in use as swap; swapoff it first")
        holders = part.holders()
        if holders:
            raise DeviceRefused(f"{device.node}: {what} is in use by {', '.join(holders)} (device mapper, LVM or md "
                                "RAID: <sysfs>/holders); remove that first")


def device_of_partition(disk: BlockDevice, name: str) -> BlockDevice | None:
    return device_from_dir(disk.sys_dir / name)


def _check_not_system_disk(device: BlockDevice, sysfs_root: Path, mountinfo: Path) -> None:
    """Never a device on the disk that holds / or /boot (through dm and md to the disks below)."""
    by_mount_point = {point: dev for dev, point in mounted_devices(mountinfo).items()}
    for point in SYSTEM_MOUNTS:
        dev = by_mount_point.get(point)
        if dev is None:
            continue
        major, minor = (int(n) for n in dev.split(":"))
        system = device_of_number(os.makedev(major, minor), sysfs_root)
        if system is None:
            continue
        disks = disks_under(system, sysfs_root)
        if device.disk_name in disks or device.name in disks:
            raise DeviceRefused(f"{device.node} is on {device.disk_name}, the disk that holds {point}: colibri-convert "
                                "never writes there")


def _read_direct(fd: int, offset: int, length: int) -> bytes:
    """``length`` bytes at ``offset`` through an O_DIRECT descriptor: into a page-aligned buffer."""
    if length <= 0:
        return b""
    buffer = mmap.mmap(-1, length)
    try:
        got = os.preadv(fd, [buffer], offset)
        return bytes(buffer[:got])
    finally:
        buffer.close()


def _signatures(fd: int, device: BlockDevice, resolved: str) -> list[sig.Signature]:
    head = _read_direct(fd, 0, min(sig.HEAD_BYTES, device.size_bytes))
    tail_offset = max(device.size_bytes - sig.TAIL_BYTES, 0)
    tail = _read_direct(fd, tail_offset, device.size_bytes - tail_offset)
    found = sig.find_signatures(head, tail, tail_offset, device.size_bytes, device.logical_block_bytes)
    from_blkid, problem = sig.blkid_signatures(resolved)
    if problem:
        log.info("%s: %s; checked the signatures Colibri reads itself", resolved, problem)
    kinds = {s.kind for s in found}  # blkid's answer adds only what our own reading missed
    return found + [s for s in from_blkid if s.kind not in kinds]


def _partition_signatures(fd: int, disk: BlockDevice, sysfs_root: Path):
    """(partition, its signatures) of each partition of a whole disk, read through the disk."""
    for name in disk.partitions():
        part = device_of_partition(disk, name)
        start = read_attribute(disk.sys_dir / name, "start")
        if part is None or start is None or not start.isdigit():
            continue
        offset = int(start) * SECTOR_BYTES
        head = _read_direct(fd, offset, min(sig.HEAD_BYTES, part.size_bytes))
        tail_offset = max(part.size_bytes - sig.TAIL_BYTES, 0)
        tail = _read_direct(fd, offset + tail_offset, part.size_bytes - tail_offset)
        yield part, sig.find_signatures(head, tail, tail_offset, part.size_bytes, disk.logical_block_bytes)


def _check_signatures(found: list[sig.Signature], device: BlockDevice, what: str,
                      options: WriteOptions) -> list[sig.Signature]:
    """Refuse unless the flags allow each signature; returns those that will be destroyed."""
    tables = [s for s in found if s.kind == "partition table"]
    if (tables or device.partitions()) and not device.is_partition and not options.whole_disk:
        table = tables[0].name if tables else "partitions"
        raise DeviceRefused(f"{what} is a whole disk with a partition table ({table}: "
                            f"{', '.join(device.partitions()) or 'no partitions listed'}); give one of its "
                            "partitions, or pass --whole-disk to overwrite the whole disk, partition table included")
    colibri = [s for s in found if s.kind == "colibri"]
    if colibri and not (options.replace_pack or options.force_overwrite):
        raise DeviceRefused(f"{what} already holds {colibri[0].describe()}: pass --force to replace that pack's "
                            "experts (its manifest then no longer opens)")
    others = [s for s in found if s.kind not in ("partition table", "colibri")]
    if others and not options.force_overwrite:
        raise DeviceRefused(f"{what} holds {'; '.join(s.describe() for s in others)}: pass --force-overwrite to "
                            "destroy it")
    return others + tables + colibri
