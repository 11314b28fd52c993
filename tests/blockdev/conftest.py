"""Real loop devices for the tests that write packs to raw block devices: each is attached to
a sparse file in the test's directory and always detached afterwards (and unmounted first, if
the test mounted it), even when the test fails. Skipped without root or losetup."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

MIB = 1 << 20


class LoopDevices:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.attached: list[str] = []
        self.mounted: list[Path] = []

    def attach(self, size_bytes: int, name: str = "disk.img", sector_bytes: int = 512, partitions: bool = False,
               image: Path | None = None) -> Path:
        """A loop device on a new sparse file of ``size_bytes`` (or on ``image``)."""
        if image is None:
            image = self.directory / name
            with open(image, "wb") as f:
                f.truncate(size_bytes)
        command = ["losetup", "--find", "--show", "--sector-size", str(sector_bytes)]
        result = subprocess.run(command + (["--partscan"] if partitions else []) + [str(image)],
                                capture_output=True, text=True, timeout=30)
        if result.returncode != 0:
            pytest.skip(f"losetup cannot attach a loop device here: {result.stderr.strip()}")
        node = result.stdout.strip()
        self.attached.append(node)
        if partitions and not Path(f"{node}p1").exists() and shutil.which("partx"):
            # A kernel without the DOS partition parser ignores --partscan; partx adds them (BLKPG).
            subprocess.run(["partx", "--add", node], capture_output=True, timeout=30)
        return Path(node)

    def detach(self, node: Path) -> None:
        subprocess.run(["losetup", "-d", str(node)], capture_output=True, timeout=30)
        if str(node) in self.attached:
            self.attached.remove(str(node))

    def mount(self, node: Path) -> Path:
        point = self.directory / f"mnt-{node.name}"
        point.mkdir()
        subprocess.run(["mount", str(node), str(point)], check=True, capture_output=True, timeout=30)
        self.mounted.append(point)
        return point

    def cleanup(self) -> None:
        for point in reversed(self.mounted):
            subprocess.run(["umount", str(point)], capture_output=True, timeout=30)
        for node in reversed(self.attached):
            subprocess.run(["losetup", "-d", node], capture_output=True, timeout=30)
        self.attached.clear()


@pytest.fixture
def loops(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("loop devices need root")
    if shutil.which("losetup") is None:
        pytest.skip("losetup is not installed")
    made = LoopDevices(tmp_path)
    try:
        yield made
    finally:
        made.cleanup()


def write_mbr(image: Path, partitions: list[tuple[int, int]], partition_type: int = 0x83) -> None:
    """A DOS partition table (what sfdisk would write) on ``image``: (first sector, sectors) per
    partition, 512-byte sectors."""
    entries = b""
    for first, sectors in partitions:
        # status, CHS first (unused: 0xFE 0xFF 0xFF), type, CHS last, LBA first, sectors
        entries += struct.pack("<B3sB3sII", 0, b"\xfe\xff\xff", partition_type, b"\xfe\xff\xff", first, sectors)
    with open(image, "r+b") as f:
        f.seek(446)
        f.write(entries.ljust(64, b"\0") + b"\x55\xaa")


def mkfs_ext4(target: Path) -> None:
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("mkfs.ext4 is not installed")
    subprocess.run(["mkfs.ext4", "-q", "-F", str(target)], check=True, capture_output=True, timeout=60)
