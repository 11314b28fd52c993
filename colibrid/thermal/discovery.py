"""Which NVMe drive(s) a file lives on, found by walking sysfs.

    file --stat--> st_dev (MAJ:MIN) --<sysfs>/dev/block/MAJ:MIN--> block device directory
    (a device node, for experts on a raw device: its st_rdev)
         partition? -> its parent, the disk       device mapper / md? -> each of its slaves
         loop device? -> its loop/backing_file -> that file's device, and on from there
         disk nvme0n1 -> the controller nvme0 above it (or, with native multipath, the
                         controllers of its nvme-subsystem) -> model, serial, firmware_rev,
                         the namespace's queue/logical_block_size, the controller's hwmon

Why sysfs paths and not pyudev: libudev always reads the real /sys, and the tests must run
against a fake tree (this project's machines have no NVMe at all). Everything here takes a
``sysfs_root``; pyudev is used by the watch only, as the source of hot-plug events. Sysfs
attributes are read directly each time: they are small files and the answer must be fresh.

A file that is not on NVMe (tmpfs, a network file system, virtio, SATA) gets a plain reason
instead of drives: Colibri then runs unthrottled and says so.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

SYSFS_ROOT = Path("/sys")
DEV_ROOT = Path("/dev")
MOUNTINFO = Path("/proc/self/mountinfo")

_CONTROLLER_NAME = re.compile(r"nvme\d+$")
_NAMESPACE_NAME = re.compile(r"nvme\d+(c\d+)?n\d+$")
# Stacked block devices (dm-crypt, LVM, md RAID) are followed through their slaves this deep.
_MAX_STACK_DEPTH = 8


@dataclass(frozen=True)
class NvmeDrive:
    """One NVMe namespace holding (part of) the file, and the controller that serves it."""

    controller: str  # "nvme0": the character device /dev/nvme0 and the hwmon belong to it
    namespace: str  # "nvme0n1"
    block_device: str  # the device the file system is on: "nvme0n1p2", or the namespace itself
    model: str
    serial: str
    firmware: str
    logical_block_bytes: int | None
    controller_dir: Path  # resolved sysfs directory of the controller
    hwmon_dir: Path | None  # its hwmon (name "nvme"); None on kernels before 5.5
    char_device: Path  # /dev/nvme0: the admin commands (SMART log) go there

    def describe(self) -> dict:
        return {"controller": self.controller, "namespace": self.namespace, "block_device": self.block_device,
                "model": self.model, "serial": self.serial, "firmware": self.firmware,
                "logical_block_bytes": self.logical_block_bytes}


@dataclass(frozen=True)
class Placement:
    """Where a file lives: its NVMe drives, or why there are none."""

    path: Path
    drives: tuple[NvmeDrive, ...]
    no_nvme_reason: str | None = None  # set exactly when drives is empty


def _read_attribute(directory: Path, name: str) -> str | None:
    try:
        return (directory / name).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _mount_of(dev: str, mountinfo: Path) -> tuple[str, str] | None:
    """(file system type, source) of the mount whose device number is ``dev`` ("0:27")."""
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        # id parent MAJ:MIN root mountpoint options [optional fields] - fstype source superoptions
        fields, _, tail = line.partition(" - ")
        parts, tail_parts = fields.split(), tail.split()
        if len(parts) >= 3 and parts[2] == dev and len(tail_parts) >= 2:
            return tail_parts[0], tail_parts[1]
    return None


def _block_dir_of(dev: str, sysfs_root: Path) -> Path | None:
    link = sysfs_root / "dev" / "block" / dev
    return link.resolve() if link.exists() else None


def _disk_of(block_dir: Path) -> Path:
    """A partition's disk (its parent directory); a disk is its own."""
    return block_dir.parent if (block_dir / "partition").exists() else block_dir


def _controllers_of_namespace(namespace_dir: Path, sysfs_root: Path) -> list[Path]:
    """The controller directories serving a namespace: the nvmeN above it, or — for a native
    multipath head under virtual/nvme-subsystem — the nvmeN links of its subsystem."""
    root = sysfs_root.resolve()
    for ancestor in namespace_dir.parents:
        if ancestor == root or root not in ancestor.parents:
            break
        if _CONTROLLER_NAME.match(ancestor.name) and (ancestor / "serial").exists():
            return [ancestor]
    subsystem = namespace_dir.parent
    return sorted((entry.resolve() for entry in subsystem.iterdir()
                   if _CONTROLLER_NAME.match(entry.name) and (entry / "serial").exists()), key=lambda p: p.name)


def find_hwmon(controller_dir: Path) -> Path | None:
    """The controller's hwmon directory (its `name` is "nvme"): under the controller on newer
    kernels, under its PCI device on 5.5-5.x."""
    candidates = [*controller_dir.glob("hwmon*"), *controller_dir.glob("hwmon/hwmon*"),
                  *controller_dir.glob("device/hwmon/hwmon*"), *controller_dir.glob("device/hwmon*")]
    for candidate in sorted(set(candidates)):
        if candidate.is_dir() and _read_attribute(candidate, "name") == "nvme":
            return candidate
    return None


def _drive(namespace_dir: Path, block_name: str, controller_dir: Path, dev_root: Path) -> NvmeDrive:
    block_size = _read_attribute(namespace_dir / "queue", "logical_block_size")
    return NvmeDrive(
        controller=controller_dir.name, namespace=namespace_dir.name, block_device=block_name,
        model=_read_attribute(controller_dir, "model") or "?", serial=_read_attribute(controller_dir, "serial") or "?",
        firmware=_read_attribute(controller_dir, "firmware_rev") or "?",
        logical_block_bytes=int(block_size) if block_size and block_size.isdigit() else None,
        controller_dir=controller_dir, hwmon_dir=find_hwmon(controller_dir),
        char_device=dev_root / controller_dir.name)


def _kind_of(disk_dir: Path) -> str:
    """What a non-NVMe disk is, in words people know: "virtio_blk", "sd (SCSI/SATA)", "loop"."""
    driver = (disk_dir / "device" / "driver")
    if driver.exists():
        name = driver.resolve().name
        return "sd (SCSI/SATA)" if name == "sd" else name
    if "virtual" in disk_dir.parts:
        return re.sub(r"\d+$", "", disk_dir.name) or "virtual"
    return "unknown driver"


def _nvme_behind(block_dir: Path, sysfs_root: Path, dev_root: Path, depth: int = 0,
                 mountinfo: Path = MOUNTINFO) -> tuple[list[NvmeDrive], list[str]]:
    """(NVMe drives under a block device, descriptions of the non-NVMe devices found instead)."""
    disk_dir = _disk_of(block_dir)
    backing = _read_attribute(disk_dir / "loop", "backing_file")
    if backing is not None and depth < _MAX_STACK_DEPTH:
        # A loop device reads a file: the drive is the one under that file's file system.
        below, why = _block_dir_of_file(Path(backing), sysfs_root, mountinfo)
        if below is None:
            return [], [f"{block_dir.name} (a loop device on {backing}: {why})"]
        return _nvme_behind(below, sysfs_root, dev_root, depth + 1, mountinfo)
    if _NAMESPACE_NAME.match(disk_dir.name):
        controllers = _controllers_of_namespace(disk_dir, sysfs_root)
        if controllers:
            return [_drive(disk_dir, block_dir.name, c, dev_root) for c in controllers], []
        return [], [f"{block_dir.name} (an NVMe namespace whose controller is not in sysfs)"]
    slaves_dir = block_dir / "slaves"
    slaves = sorted(slaves_dir.iterdir()) if slaves_dir.is_dir() else []
    if slaves and depth < _MAX_STACK_DEPTH:  # dm-crypt, LVM, md: follow what it is built on
        drives, others = [], []
        for slave in slaves:
            d, o = _nvme_behind(slave.resolve(), sysfs_root, dev_root, depth + 1, mountinfo)
            drives += d
            others += o
        return drives, others
    return [], [f"{block_dir.name} ({_kind_of(disk_dir)})"]


def _unique(drives: list[NvmeDrive]) -> tuple[NvmeDrive, ...]:
    """One entry per controller: RAID over two namespaces of one drive is still one drive."""
    seen: dict[str, NvmeDrive] = {}
    for drive in drives:
        seen.setdefault(drive.controller, drive)
    return tuple(seen.values())


def _block_dir_of_file(path: Path, sysfs_root: Path, mountinfo: Path) -> tuple[Path | None, str]:
    """(the sysfs directory of the block device ``path`` is on - or is, for a device node -,
    None and why not)."""
    try:
        info = os.stat(path)
    except OSError as exc:
        return None, f"cannot stat {path} ({exc.strerror})"
    number = info.st_rdev if stat.S_ISBLK(info.st_mode) else info.st_dev
    dev = f"{os.major(number)}:{os.minor(number)}"
    block_dir = _block_dir_of(dev, sysfs_root)
    if block_dir is not None or stat.S_ISBLK(info.st_mode):
        return block_dir, f"{path} is block device {dev}, which sysfs does not list"
    mount = _mount_of(dev, mountinfo)
    if mount is not None and mount[1].startswith("/dev/"):
        # btrfs and friends give files an anonymous device number; the mount names the real one.
        try:
            rdev = os.stat(mount[1]).st_rdev
            block_dir = _block_dir_of(f"{os.major(rdev)}:{os.minor(rdev)}", sysfs_root) if rdev else None
        except OSError:
            pass
    if block_dir is None:
        what = f"{mount[0]} ({mount[1]})" if mount else f"device {dev}"
        return None, f"{path} is on {what}, not a block device"
    return block_dir, ""


def find_drives(path: Path, sysfs_root: Path = SYSFS_ROOT, dev_root: Path = DEV_ROOT,
                mountinfo: Path = MOUNTINFO) -> Placement:
    """The NVMe drives ``path`` lives on, or the reason there are none. ``path`` is a file (the
    experts file) or a block device node (a pack's experts on a raw device): then the device
    itself, through partitions, loop devices, dm and md, down to the drive."""
    path = Path(path)
    block_dir, why = _block_dir_of_file(path, sysfs_root, mountinfo)
    if block_dir is None:
        return Placement(path, (), f"no NVMe device: {why}")
    drives, others = _nvme_behind(block_dir, sysfs_root, dev_root, mountinfo=mountinfo)
    if not drives:
        return Placement(path, (), f"no NVMe device: {path} is on {', '.join(others)}")
    return Placement(path, _unique(drives))
