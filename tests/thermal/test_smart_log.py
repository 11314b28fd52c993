"""The SMART / Health log page parsed by offset from its raw bytes, and the sources that fetch it."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from colibrid.thermal.smart_log import SmartLogError, parse_smart_log
from colibrid.thermal.smart_source import (
    NVME_IOCTL_ADMIN_CMD, IoctlSmartSource, NvmeAdminCommand, SmartUnavailable, choose_smart_source,
    get_log_page_command, smart_health_from_smartctl,
)

# A recorded page (hexdump in the comments): byte 0 = 0x06 (bits 1 and 2), bytes 1-2 = 57 01
# (343 K), spare 0x57 (87 %), threshold 0x0a, used 0x0d (13 %), data units read 2^70 + 5,
# written 123456789, power-on hours 8760, unsafe shutdowns 17, media errors 2, error log
# entries 9, warning temperature time 42 min, critical 3 min, sensors 345 K and 338 K.
RECORDED_PAGE = Path(__file__).parent / "data" / "smart-log-02h.bin"


def test_a_recorded_page_parses_to_its_values():
    health = parse_smart_log(RECORDED_PAGE.read_bytes())
    assert health.critical_warning == 0x06
    assert health.critical_warnings == ["temperature beyond a threshold",
                                        "reliability degraded (media or internal errors)"]
    assert health.composite_c == 69.85  # 343 K
    assert (health.available_spare_pct, health.available_spare_threshold_pct, health.percentage_used) == (87, 10, 13)
    assert health.data_units_read == 2**70 + 5  # a 128-bit counter, little-endian
    assert health.data_units_written == 123_456_789
    assert (health.power_on_hours, health.unsafe_shutdowns) == (8760, 17)
    assert (health.media_errors, health.error_log_entries) == (2, 9)
    assert (health.warning_temperature_minutes, health.critical_temperature_minutes) == (42, 3)
    assert health.sensors_c == (71.85, 64.85, None, None, None, None, None, None)  # 0 K: not implemented


def test_every_critical_warning_bit_has_a_name():
    page = bytearray(RECORDED_PAGE.read_bytes())
    page[0] = 0xFF
    words = parse_smart_log(bytes(page)).critical_warnings
    assert words[0] == "available spare below threshold" and words[3] == "media placed in read-only mode"
    assert words[-2:] == ["reserved bit 6", "reserved bit 7"]
    page[0] = 0
    assert parse_smart_log(bytes(page)).critical_warnings == []


@pytest.mark.parametrize("length", [0, 511, 513, 4096])
def test_a_page_of_the_wrong_size_is_refused(length):
    with pytest.raises(SmartLogError, match="512 bytes"):
        parse_smart_log(bytes(length))


def test_the_admin_command_asks_for_the_whole_smart_page():
    assert NVME_IOCTL_ADMIN_CMD == 0xC0484E41  # _IOWR('N', 0x41, struct nvme_admin_cmd) on x86-64
    buffer = ctypes.create_string_buffer(512)
    command = get_log_page_command(buffer)
    assert ctypes.sizeof(NvmeAdminCommand) == 72
    assert command.opcode == 0x02 and command.nsid == 0xFFFFFFFF
    assert command.data_len == 512 and command.addr == ctypes.addressof(buffer)
    assert command.cdw10 == (127 << 16) | 0x02  # NUMDL = 128 dwords - 1, log id 02h


def test_smartctl_json_maps_to_the_same_fields():
    report = {"nvme_smart_health_information_log": {
        "critical_warning": 2, "temperature": 71, "available_spare": 100, "available_spare_threshold": 10,
        "percentage_used": 4, "data_units_read": 10, "data_units_written": 20, "power_on_hours": 300,
        "unsafe_shutdowns": 1, "media_errors": 0, "num_err_log_entries": 5, "warning_temp_time": 7,
        "critical_comp_time": 0, "temperature_sensors": [71, 60]}}
    health = smart_health_from_smartctl(report)
    assert health.composite_c == 71.0 and health.critical_warnings == ["temperature beyond a threshold"]
    assert health.sensors_c == (71.0, 60.0, None, None, None, None, None, None)
    assert health.warning_temperature_minutes == 7 and health.error_log_entries == 5
    with pytest.raises(SmartUnavailable):
        smart_health_from_smartctl({"smartctl": {"exit_status": 2}})


def test_without_a_readable_device_no_source_is_chosen_and_each_failure_is_said(tmp_path):
    source, health, failures = choose_smart_source(tmp_path / "nvme0", [IoctlSmartSource()])
    assert source is None and health is None
    assert failures == [f"ioctl: cannot open {tmp_path / 'nvme0'}: No such file or directory"]


class RecordedSource:
    name = "recorded"

    def read(self, char_device):
        return parse_smart_log(RECORDED_PAGE.read_bytes())


def test_the_first_source_that_reads_is_chosen(tmp_path):
    source, health, failures = choose_smart_source(tmp_path / "nvme0", [IoctlSmartSource(), RecordedSource()])
    assert source.name == "recorded" and health.composite_c == 69.85 and len(failures) == 1
