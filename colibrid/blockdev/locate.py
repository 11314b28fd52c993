"""Find the block device that carries a pack's experts region, by its superblock.

A device's name changes (loop4 today, loop2 tomorrow; nvme0n1p3 after a drive is moved),
and a name in a manifest could point anywhere, so a name is only where to look first:
every candidate is opened read-only, checked to be the block device sysfs lists under that
number (fstat on the descriptor), and accepted only if its superblock is valid, carries the
pack id, and its region fits inside the device.

Candidates, in order: the device the manifest names, then those whose identity matches
(serial, wwid, a loop device's backing file), then every other block device large enough.
A device this process may not read is skipped and reported (the udev rule in
udev/61-colibri-pack.rules gives the colibri group read access to Colibri devices).
"""

from __future__ import annotations

import errno
import os
import stat
import uuid
from dataclasses import dataclass
from pathlib import Path

from colibrid.blockdev.superblock import SUPERBLOCK_BLOCK_BYTES, Superblock, SuperblockError
from colibrid.blockdev.sysfs import SYSFS_ROOT, BlockDevice, all_devices

DEV_ROOT = Path("/dev")
_IDENTITY_KEYS = ("wwid", "serial", "loop_backing_file")


class DeviceNotFound(Exception):
    """No readable block device carries the pack id; the message lists what was skipped."""


@dataclass
class FoundDevice:
    """An open, read-only descriptor of the device that carries the pack (the caller closes it)."""

    fd: int
    node: Path  # the device node it was opened at
    device: BlockDevice
    superblock: Superblock

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _ranked(devices: list[BlockDevice], identity: dict) -> list[BlockDevice]:
    """The named device first, then those with a matching identity, then the rest."""
    def rank(device: BlockDevice) -> int:
        if device.name == identity.get("name"):
            return 0
        mine = device.identity()
        if any(identity.get(key) and mine.get(key) == identity.get(key) for key in _IDENTITY_KEYS):
            return 1
        return 2
    return sorted(devices, key=rank)


def open_candidate(device: BlockDevice, dev_root: Path = DEV_ROOT) -> int:
    """A read-only descriptor of ``device``'s node, checked to be that very device."""
    node = dev_root / device.name
    fd = os.open(node, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISBLK(info.st_mode) or f"{os.major(info.st_rdev)}:{os.minor(info.st_rdev)}" != device.dev:
            raise OSError(errno.ENODEV, f"{node} is not block device {device.dev}")
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_superblock(fd: int) -> Superblock:
    """The superblock at the start of an open device (SuperblockError if there is none)."""
    return Superblock.decode(os.pread(fd, SUPERBLOCK_BLOCK_BYTES, 0))


def find_pack_device(pack_id: str, identity: dict, min_bytes: int, sysfs_root: Path = SYSFS_ROOT,
                     dev_root: Path = DEV_ROOT) -> FoundDevice:
    """The device whose superblock carries ``pack_id`` and that has at least ``min_bytes``."""
    wanted = uuid.UUID(pack_id)
    unreadable, mismatched = [], []
    for device in _ranked([d for d in all_devices(sysfs_root) if d.size_bytes >= min_bytes], identity):
        try:
            fd = open_candidate(device, dev_root)
        except OSError as exc:
            if device.name == identity.get("name") or exc.errno in (errno.EACCES, errno.EPERM):
                unreadable.append(f"{device.node} ({exc.strerror or exc})")
            continue
        try:
            superblock = read_superblock(fd)
        except (OSError, SuperblockError) as exc:
            if device.name == identity.get("name"):
                mismatched.append(f"{device.node}: {exc}")
            os.close(fd)
            continue
        if superblock.pack_id != wanted or superblock.end_bytes > device.size_bytes:
            why = (f"carries pack id {superblock.pack_id}" if superblock.pack_id != wanted else
                   f"its region ends at byte {superblock.end_bytes}, past the device's {device.size_bytes}")
            mismatched.append(f"{device.node} {why}")
            os.close(fd)
            continue
        return FoundDevice(fd, dev_root / device.name, device, superblock)
    raise DeviceNotFound(_not_found_message(pack_id, identity, unreadable, mismatched))


def _not_found_message(pack_id: str, identity: dict, unreadable: list[str], mismatched: list[str]) -> str:
    was = identity.get("name")
    described = ", ".join(f"{k} {identity[k]}" for k in ("serial", "model", "loop_backing_file", "partition")
                          if identity.get(k) is not None)
    message = (f"no block device carries the Colibri superblock of pack id {pack_id}"
               + (f" (written to /dev/{was}" + (f": {described}" if described else "") + ")" if was else ""))
    if mismatched:
        message += f"; found instead: {'; '.join(mismatched[:4])}"
    if unreadable:
        message += (f"; not readable here: {', '.join(unreadable[:6])}"
                    " (the colibri group gets read access through udev/61-colibri-pack.rules)")
    return message + ": attach the device, or convert the checkpoint again"
