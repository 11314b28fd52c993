"""Discovery from a real file's device number into a fake sysfs tree: the NVMe controller and
namespace behind it, or a plain "no NVMe device" and why."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from colibrid.thermal.discovery import find_drives
from tests.thermal.fake_sysfs import file_dev


def test_a_file_on_an_nvme_partition(sysfs, tmp_path):
    fake = sysfs.add_nvme(file_dev(tmp_path), logical_block_bytes=4096)
    placement = find_drives(tmp_path, sysfs.sys, sysfs.dev)
    assert placement.no_nvme_reason is None
    (drive,) = placement.drives
    assert drive.describe() == {"controller": "nvme0", "namespace": "nvme0n1", "block_device": "nvme0n1p1",
                                "model": "Fake NVMe 980 PRO 1TB", "serial": "S5GXNF0R123456", "firmware": "5B2QGXA7",
                                "logical_block_bytes": 4096}
    assert drive.hwmon_dir == fake.hwmon_dir.resolve()
    assert drive.char_device == sysfs.dev / "nvme0"


def test_hwmon_under_the_pci_device_as_on_older_kernels(sysfs, tmp_path):
    fake = sysfs.add_nvme(file_dev(tmp_path), hwmon="device")
    (drive,) = find_drives(tmp_path, sysfs.sys, sysfs.dev).drives
    assert drive.hwmon_dir is not None and drive.hwmon_dir.resolve() == fake.hwmon_dir.resolve()


def test_a_whole_namespace_without_a_partition_and_without_hwmon(sysfs, tmp_path):
    sysfs.add_nvme(file_dev(tmp_path), partition=False, hwmon=None)
    (drive,) = find_drives(tmp_path, sysfs.sys, sysfs.dev).drives
    assert drive.block_device == "nvme0n1" and drive.hwmon_dir is None


def test_through_device_mapper_to_the_nvme_below(sysfs, tmp_path):
    """dm-crypt / LVM: the file system's device is dm-0, built on an NVMe partition."""
    fake = sysfs.add_nvme("259:1")  # the partition has its own number
    dm = sysfs.sys / "devices" / "virtual" / "block" / "dm-0"
    (dm / "slaves").mkdir(parents=True)
    (dm / "slaves" / "nvme0n1p1").symlink_to(os.path.relpath(fake.holder_dir, dm / "slaves"))
    (sysfs.sys / "dev" / "block" / file_dev(tmp_path)).symlink_to(os.path.relpath(dm, sysfs.sys / "dev" / "block"))
    (drive,) = find_drives(tmp_path, sysfs.sys, sysfs.dev).drives
    assert (drive.controller, drive.block_device) == ("nvme0", "nvme0n1p1")


def test_native_multipath_finds_the_subsystems_controller(sysfs, tmp_path):
    """With NVMe multipath the visible namespace lives under virtual/nvme-subsystem."""
    fake = sysfs.add_nvme("259:9", partition=False)
    subsystem = sysfs.sys / "devices" / "virtual" / "nvme-subsystem" / "nvme-subsys0"
    head = subsystem / "nvme0n1"
    (head / "queue").mkdir(parents=True)
    (head / "queue" / "logical_block_size").write_text("512\n")
    (subsystem / "nvme0").symlink_to(os.path.relpath(fake.controller_dir, subsystem))
    (sysfs.sys / "dev" / "block" / file_dev(tmp_path)).symlink_to(os.path.relpath(head, sysfs.sys / "dev" / "block"))
    (drive,) = find_drives(tmp_path, sysfs.sys, sysfs.dev).drives
    assert (drive.controller, drive.namespace, drive.serial) == ("nvme0", "nvme0n1", "S5GXNF0R123456")


def test_a_virtio_disk_is_not_nvme(sysfs, tmp_path):
    """This project's build machines: the root file system on a virtio disk."""
    sysfs.add_virtio_disk(file_dev(tmp_path))
    placement = find_drives(tmp_path, sysfs.sys, sysfs.dev)
    assert placement.drives == ()
    assert placement.no_nvme_reason == f"no NVMe device: {tmp_path} is on vda (virtio_blk)"


def test_a_file_on_tmpfs_is_not_on_a_block_device(sysfs):
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.major(os.stat(shm).st_dev) != 0:
        pytest.skip("no tmpfs at /dev/shm")
    with tempfile.NamedTemporaryFile(dir=shm) as f:
        placement = find_drives(Path(f.name), sysfs.sys, sysfs.dev)
    assert placement.drives == ()
    assert placement.no_nvme_reason.startswith(f"no NVMe device: {f.name} is on tmpfs (")
    assert placement.no_nvme_reason.endswith("), not a block device")


def test_a_missing_file_says_so(sysfs, tmp_path):
    placement = find_drives(tmp_path / "gone", sysfs.sys, sysfs.dev)
    assert placement.no_nvme_reason == f"no NVMe device: cannot stat {tmp_path / 'gone'} (No such file or directory)"
