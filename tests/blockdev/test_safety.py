"""colibri-convert's rules for the device it writes the experts to, on real loop devices:
each refusal says why (and how to override, where one exists), and the override works."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from colibrid.blockdev.safety import DeviceRefused, WriteOptions, open_for_writing
from colibrid.blockdev.superblock import Superblock
from tests.blockdev.conftest import MIB, mkfs_ext4, write_mbr

NEEDED = 4 * MIB


def _open(node, needed=NEEDED, **options):
    device = open_for_writing(node, needed, WriteOptions(**options))
    device.close()
    return device


def test_a_blank_device_large_enough_is_accepted(loops):
    node = loops.attach(16 * MIB)
    device = _open(node)
    assert device.device.name == node.name and device.overwritten == []
    assert device.device.size_bytes == 16 * MIB and device.device.logical_block_bytes == 512


def test_a_device_holding_ext4_is_refused_and_accepted_with_force_overwrite(loops):
    node = loops.attach(16 * MIB)
    mkfs_ext4(node)
    with pytest.raises(DeviceRefused, match=r"holds ext.*--force-overwrite"):
        _open(node)
    device = _open(node, force_overwrite=True)
    assert any("ext" in s.name for s in device.overwritten)


def test_a_mounted_device_is_refused(loops):
    node = loops.attach(16 * MIB)
    mkfs_ext4(node)
    loops.mount(node)
    with pytest.raises(DeviceRefused, match="in use"):
        _open(node, force_overwrite=True)  # no flag overrides this


def test_a_device_smaller_than_the_experts_is_refused(loops):
    node = loops.attach(2 * MIB)
    with pytest.raises(DeviceRefused, match=r"has 2097152 bytes .* need 4194304 .* larger partition"):
        _open(node)


def test_a_partitioned_whole_disk_needs_whole_disk_and_its_partition_is_fine(loops, tmp_path):
    image = tmp_path / "disk.img"
    with open(image, "wb") as f:
        f.truncate(32 * MIB)
    write_mbr(image, [(2048, 20480), (22528, 20480)])
    disk = loops.attach(0, image=image, partitions=True)
    partition = Path(f"{disk}p1")
    if not partition.exists():
        pytest.skip("the kernel made no partition devices for the loop device (no partscan)")
    with pytest.raises(DeviceRefused, match=r"whole disk with a partition table .*--whole-disk"):
        _open(disk)
    assert _open(disk, whole_disk=True).device.partitions() == [f"{disk.name}p1", f"{disk.name}p2"]
    assert _open(partition).device.partition_number == 1


def test_a_partition_on_the_disk_holding_root_is_refused(loops, tmp_path):
    """/ is on partition 1 (a mount table that says so); partition 2 of the same disk is refused."""
    image = tmp_path / "disk.img"
    with open(image, "wb") as f:
        f.truncate(32 * MIB)
    write_mbr(image, [(2048, 20480), (22528, 20480)])
    disk = loops.attach(0, image=image, partitions=True)
    first, second = Path(f"{disk}p1"), Path(f"{disk}p2")
    if not second.exists():
        pytest.skip("the kernel made no partition devices for the loop device (no partscan)")
    rdev = os.stat(first).st_rdev
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"27 1 {os.major(rdev)}:{os.minor(rdev)} / / rw,relatime - ext4 {first} rw\n")
    with pytest.raises(DeviceRefused, match=f"is on {disk.name}, the disk that holds /"):
        open_for_writing(second, MIB, WriteOptions(force_overwrite=True, whole_disk=True), mountinfo=mountinfo)


def test_another_packs_experts_are_replaced_only_with_force(loops):
    node = loops.attach(16 * MIB)
    pack_id = uuid.uuid4()
    with open(node, "r+b") as f:
        f.write(Superblock(pack_id, 512, 8, 8, 4096).encode())
    with pytest.raises(DeviceRefused, match=f"Colibri experts region .*pack id {pack_id}.*--force"):
        _open(node)
    assert _open(node, replace_pack=True).overwritten[0].kind == "colibri"


def test_a_regular_file_is_not_a_device(tmp_path):
    path = tmp_path / "experts.img"
    path.write_bytes(bytes(4096))
    with pytest.raises(DeviceRefused, match="not a block device"):
        _open(path)


def test_a_device_that_does_not_exist(tmp_path):
    with pytest.raises(DeviceRefused, match="no such device"):
        _open(tmp_path / "nothing")
