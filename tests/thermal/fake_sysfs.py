"""A fake sysfs tree with the shape of the real one, for the thermal watch's tests.

    <root>/sys/devices/pci0000:00/0000:00:1d.0/0000:3d:00.0/         the PCI function
        nvme/nvme0/{model,serial,firmware_rev,dev}                  the controller
        nvme/nvme0/device -> ../..                                  (as in the kernel)
        nvme/nvme0/hwmon2/{name,temp1_input,...}                    hwmon, newer kernels
          (or 0000:3d:00.0/hwmon/hwmon2/...                         hwmon, 5.5 - 5.x)
        nvme/nvme0/nvme0n1/{dev,queue/logical_block_size}           the namespace
        nvme/nvme0/nvme0n1/nvme0n1p1/{dev,partition}                a partition
    <root>/sys/dev/block/MAJ:MIN -> ../../devices/.../nvme0n1p1     the device-number map

The map points the device number of a real directory (the test's tmp dir) at the fake
partition, so discovery runs from a real file's st_dev into the fake tree. Never the real /sys.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

PCI_FUNCTION = "devices/pci0000:00/0000:00:1d.0/0000:3d:00.0"


@dataclass
class FakeNvme:
    controller_dir: Path
    hwmon_dir: Path | None
    block_link: Path
    holder_dir: Path  # the block device the file system is on (the partition or the namespace)


class FakeSysfs:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.sys = root / "sys"
        self.dev = root / "dev"
        (self.sys / "dev" / "block").mkdir(parents=True, exist_ok=True)
        self.dev.mkdir(exist_ok=True)

    @staticmethod
    def _write(path: Path, text: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def _link_block(self, dev: str, target: Path) -> Path:
        link = self.sys / "dev" / "block" / dev
        if link.is_symlink():
            link.unlink()
        link.symlink_to(os.path.relpath(target, link.parent))
        return link

    def add_nvme(self, file_dev: str, controller: str = "nvme0", model: str = "Fake NVMe 980 PRO 1TB",
                 serial: str = "S5GXNF0R123456", firmware: str = "5B2QGXA7", logical_block_bytes: int = 512,
                 hwmon: str | None = "controller", warning_c: float | None = 82.0, critical_c: float | None = 85.0,
                 composite_c: float = 40.0, partition: bool = True) -> FakeNvme:
        """A controller with one namespace (and a partition), mapped from ``file_dev`` ("254:0").
        hwmon: "controller" (newer kernels), "device" (5.5-5.x: under the PCI function) or None."""
        pci = self.sys / PCI_FUNCTION
        ctrl = pci / "nvme" / controller
        ctrl.mkdir(parents=True)
        # sysfs pads model and serial with spaces: discovery must strip them.
        self._write(ctrl / "model", f"{model:<40}\n")
        self._write(ctrl / "serial", f"{serial:<20}\n")
        self._write(ctrl / "firmware_rev", f"{firmware:<8}\n")
        self._write(ctrl / "dev", "240:0\n")
        (ctrl / "device").symlink_to("../..")
        namespace = ctrl / f"{controller}n1"
        self._write(namespace / "dev", "259:0\n")
        self._write(namespace / "queue" / "logical_block_size", f"{logical_block_bytes}\n")
        holder = namespace
        if partition:
            holder = namespace / f"{controller}n1p1"
            self._write(holder / "dev", "259:1\n")
            self._write(holder / "partition", "1\n")
        hwmon_dir = None
        if hwmon == "controller":
            hwmon_dir = ctrl / "hwmon2"
        elif hwmon == "device":
            hwmon_dir = pci / "hwmon" / "hwmon2"
        if hwmon_dir is not None:
            self._write(hwmon_dir / "name", "nvme\n")
            self._write(hwmon_dir / "temp1_label", "Composite\n")
            self._write(hwmon_dir / "temp2_label", "Sensor 1\n")
            self._write(hwmon_dir / "temp3_label", "Sensor 2\n")
            if warning_c is not None:
                self._write(hwmon_dir / "temp1_max", f"{int(warning_c * 1000)}\n")
            if critical_c is not None:
                self._write(hwmon_dir / "temp1_crit", f"{int(critical_c * 1000)}\n")
            self._write(hwmon_dir / "temp1_alarm", "0\n")
        drive = FakeNvme(ctrl, hwmon_dir, self._link_block(file_dev, holder), holder)
        if hwmon_dir is not None:
            self.set_temperature(drive, composite_c)
        return drive

    @staticmethod
    def set_temperature(drive: FakeNvme, composite_c: float, sensors_c: tuple[float, ...] | None = None) -> None:
        """What the drive reports at the next poll (millidegrees, as the kernel writes them)."""
        assert drive.hwmon_dir is not None
        sensors = sensors_c if sensors_c is not None else (composite_c + 3, composite_c - 2)
        (drive.hwmon_dir / "temp1_input").write_text(f"{round(composite_c * 1000)}\n")
        for i, value in enumerate(sensors, start=2):
            (drive.hwmon_dir / f"temp{i}_input").write_text(f"{round(value * 1000)}\n")

    def remove_nvme(self, drive: FakeNvme) -> Path:
        """What hot-removal does to sysfs: the controller's tree and the dev-number link vanish.
        Returns a saved copy for add_back."""
        saved = self.root / "removed" / drive.controller_dir.name
        shutil.copytree(drive.controller_dir, saved, symlinks=True)
        shutil.rmtree(drive.controller_dir)
        drive.block_link.unlink()
        return saved

    def add_back(self, drive: FakeNvme, saved: Path) -> None:
        shutil.copytree(saved, drive.controller_dir, symlinks=True)
        shutil.rmtree(saved)
        self._link_block(drive.block_link.name, drive.holder_dir)

    def add_virtio_disk(self, file_dev: str, name: str = "vda") -> None:
        """A virtio-blk disk, driver link included, like this project's build machines."""
        disk = self.sys / "devices/pci0000:00/0000:00:02.0/virtio1/block" / name
        self._write(disk / "dev", "254:0\n")
        driver = self.sys / "bus/virtio/drivers/virtio_blk"
        driver.mkdir(parents=True, exist_ok=True)
        (disk / "device").symlink_to(os.path.relpath(disk.parent.parent, disk))
        (disk.parent.parent / "driver").symlink_to(os.path.relpath(driver, disk.parent.parent))
        self._link_block(file_dev, disk)


def file_dev(path: Path) -> str:
    """"MAJ:MIN" of the device a real file lives on."""
    st_dev = os.stat(path).st_dev
    return f"{os.major(st_dev)}:{os.minor(st_dev)}"
