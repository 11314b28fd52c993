"""hwmon read fresh each time, in °C, with the limits a drive exposes and none it does not."""

from __future__ import annotations

import pytest

from colibrid.thermal.hwmon import read_hwmon
from tests.thermal.fake_sysfs import file_dev


def test_temperatures_and_limits(sysfs, tmp_path):
    fake = sysfs.add_nvme(file_dev(tmp_path), warning_c=82.0, critical_c=85.0, composite_c=41.85)
    reading = read_hwmon(fake.hwmon_dir)
    assert reading.composite_c == 41.85
    assert reading.sensors_c == {"Sensor 1": 44.85, "Sensor 2": 39.85}
    assert (reading.warning_c, reading.critical_c, reading.alarm) == (82.0, 85.0, False)


def test_every_read_is_fresh(sysfs, tmp_path):
    fake = sysfs.add_nvme(file_dev(tmp_path))
    sysfs.set_temperature(fake, 40.0)
    assert read_hwmon(fake.hwmon_dir).composite_c == 40.0
    sysfs.set_temperature(fake, 71.5)
    assert read_hwmon(fake.hwmon_dir).composite_c == 71.5


def test_a_drive_without_limits(sysfs, tmp_path):
    fake = sysfs.add_nvme(file_dev(tmp_path), warning_c=None, critical_c=None)
    reading = read_hwmon(fake.hwmon_dir)
    assert reading.warning_c is None and reading.critical_c is None and reading.composite_c == 40.0


def test_a_removed_drive_raises(sysfs, tmp_path):
    fake = sysfs.add_nvme(file_dev(tmp_path))
    sysfs.remove_nvme(fake)
    with pytest.raises(FileNotFoundError):
        read_hwmon(fake.hwmon_dir)
