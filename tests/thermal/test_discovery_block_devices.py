"""Discovery from a block device node (a pack whose experts are on a raw device) down to the
NVMe drive: through a partition, a loop device on a file, device mapper and md RAID. Fake
sysfs trees for the drives; device nodes made with mknod (root only) so that a real st_rdev
leads into the fake tree; and a real loop device on this machine's disk."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from colibrid.thermal.discovery import find_drives
from tests.thermal.fake_sysfs import file_dev

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a block device node needs root")


def _node(tmp_path: Path, name: str, major: int, minor: int) -> Path:
    """A block device node with this number, in the test's own directory."""
    node = tmp_path / "nodes" / name
    node.parent.mkdir(exist_ok=True)
    os.mknod(node, stat.S_IFBLK | 0o600, os.makedev(major, minor))
    return node


def _virtual_block(sysfs, name: str, dev: str) -> Path:
    directory = sysfs.sys / "devices" / "virtual" / "block" / name
    directory.mkdir(parents=True)
    (directory / "dev").write_text(f"{dev}\n")
    sysfs._link_block(dev, directory)
    return directory


def _slave(holder: Path, below: Path) -> None:
    (holder / "slaves").mkdir(exist_ok=True)
    (holder / "slaves" / below.name).symlink_to(os.path.relpath(below, holder / "slaves"))


@needs_root
def test_a_partition_node_leads_to_its_nvme_drive(sysfs, tmp_path):
    sysfs.add_nvme("259:1", logical_block_bytes=4096)  # the partition nvme0n1p1
    placement = find_drives(_node(tmp_path, "nvme0n1p1", 259, 1), sysfs.sys, sysfs.dev)
    (drive,) = placement.drives
    assert (drive.controller, drive.namespace, drive.block_device) == ("nvme0", "nvme0n1", "nvme0n1p1")
    assert drive.logical_block_bytes == 4096


@needs_root
def test_a_loop_device_leads_through_its_backing_file_to_the_drive_under_it(sysfs, tmp_path):
    """loop0 reads a file; the file's file system is on the NVMe partition."""
    backing = tmp_path / "experts.img"
    backing.write_bytes(b"\0" * 4096)
    sysfs.add_nvme(file_dev(backing))
    loop = _virtual_block(sysfs, "loop0", "7:0")
    (loop / "loop").mkdir()
    (loop / "loop" / "backing_file").write_text(f"{backing}\n")
    (drive,) = find_drives(_node(tmp_path, "loop0", 7, 0), sysfs.sys, sysfs.dev).drives
    assert (drive.controller, drive.block_device) == ("nvme0", "nvme0n1p1")


@needs_root
def test_a_loop_device_whose_file_is_gone_says_so(sysfs, tmp_path):
    loop = _virtual_block(sysfs, "loop0", "7:0")
    (loop / "loop").mkdir()
    (loop / "loop" / "backing_file").write_text(f"{tmp_path / 'deleted.img'} (deleted)\n")
    placement = find_drives(_node(tmp_path, "loop0", 7, 0), sysfs.sys, sysfs.dev)
    assert placement.drives == () and "loop0 (a loop device on" in placement.no_nvme_reason


@needs_root
def test_a_device_mapper_node_leads_to_the_nvme_below(sysfs, tmp_path):
    fake = sysfs.add_nvme("259:1")
    dm = _virtual_block(sysfs, "dm-0", "253:0")
    _slave(dm, fake.holder_dir)
    (drive,) = find_drives(_node(tmp_path, "dm-0", 253, 0), sysfs.sys, sysfs.dev).drives
    assert (drive.controller, drive.block_device) == ("nvme0", "nvme0n1p1")


@needs_root
def test_an_md_raid_node_leads_to_every_drive_it_spans(sysfs, tmp_path):
    first = sysfs.add_nvme("259:1", controller="nvme0", serial="SERIAL0")
    second = sysfs.add_nvme("259:3", controller="nvme1", serial="SERIAL1")
    md = _virtual_block(sysfs, "md0", "9:0")
    _slave(md, first.holder_dir)
    _slave(md, second.holder_dir)
    drives = find_drives(_node(tmp_path, "md0", 9, 0), sysfs.sys, sysfs.dev).drives
    assert sorted((d.controller, d.serial) for d in drives) == [("nvme0", "SERIAL0"), ("nvme1", "SERIAL1")]


@needs_root
def test_a_node_sysfs_does_not_list_is_no_nvme_with_the_reason(sysfs, tmp_path):
    placement = find_drives(_node(tmp_path, "nothing", 250, 9), sysfs.sys, sysfs.dev)
    assert placement.drives == () and "block device 250:9, which sysfs does not list" in placement.no_nvme_reason


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("losetup") is None, reason="needs root and losetup")
def test_a_real_loop_device_is_followed_to_the_disk_under_its_file(tmp_path):
    """On this machine: a loop device on a file in the test's directory is on the same disk as
    the file itself (there is no NVMe here, so the reason names that disk)."""
    image = tmp_path / "loop.img"
    with open(image, "wb") as f:
        f.truncate(1 << 20)
    node = subprocess.run(["losetup", "--find", "--show", str(image)], capture_output=True, text=True,
                          check=True).stdout.strip()
    try:
        through_loop = find_drives(Path(node))
        direct = find_drives(image)
    finally:
        subprocess.run(["losetup", "-d", node], check=False)
    if direct.drives:  # a machine whose disk is NVMe: the same drive both ways
        assert [d.controller for d in through_loop.drives] == [d.controller for d in direct.drives]
    else:
        assert through_loop.no_nvme_reason.split(" is on ")[1] == direct.no_nvme_reason.split(" is on ")[1]
        assert "loop" not in through_loop.no_nvme_reason.split(" is on ")[1]
