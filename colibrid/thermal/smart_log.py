"""The SMART / Health Information log page (Log Identifier 02h), parsed from its 512 raw bytes.

Offsets from the NVM Express Base Specification; every field is little-endian, temperatures
are Kelvin (0 = sensor not implemented), counters of 16 bytes are 128-bit:

    0        critical warning bits (CRITICAL_WARNING_BITS)
    1-2      composite temperature (K)
    3        available spare (%)             4   available spare threshold (%)
    5        percentage used (may exceed 100) 6  endurance group critical warning summary
    32-47    data units read (1000 x 512 bytes)        48-63   data units written
    64-79    host read commands                        80-95   host write commands
    96-111   controller busy time (minutes)            112-127 power cycles
    128-143  power-on hours                            144-159 unsafe shutdowns
    160-175  media and data integrity errors           176-191 error information log entries
    192-195  warning composite temperature time (minutes above WCTEMP)
    196-199  critical composite temperature time (minutes above CCTEMP)
    200-215  temperature sensors 1-8 (K each)

We parse the page ourselves rather than a tool's text: the bytes are specified, the text of
nvme-cli and smartctl changes between versions.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

LOG_PAGE_BYTES = 512
KELVIN_OFFSET = 273.15
# Bit -> what it means when set.
CRITICAL_WARNING_BITS = {
    0: "available spare below threshold",
    1: "temperature beyond a threshold",
    2: "reliability degraded (media or internal errors)",
    3: "media placed in read-only mode",
    4: "volatile memory backup device failed",
    5: "persistent memory region read-only or unreliable",
}

_HEADER = struct.Struct("<BHBBBB")  # bytes 0-6
_TEMPERATURE_TIMES = struct.Struct("<II")  # bytes 192-199
_SENSORS = struct.Struct("<8H")  # bytes 200-215


class SmartLogError(ValueError):
    """Bytes that cannot be a SMART / Health Information log page."""


@dataclass(frozen=True)
class SmartHealth:
    critical_warning: int  # the raw bits
    composite_c: float | None
    available_spare_pct: int
    available_spare_threshold_pct: int
    percentage_used: int
    data_units_read: int
    data_units_written: int
    power_on_hours: int
    unsafe_shutdowns: int
    media_errors: int
    error_log_entries: int
    warning_temperature_minutes: int
    critical_temperature_minutes: int
    sensors_c: tuple[float | None, ...]  # sensors 1-8; None where not implemented

    @property
    def critical_warnings(self) -> list[str]:
        """The set bits, in words (reserved bits 6-7 by number)."""
        return [CRITICAL_WARNING_BITS.get(bit, f"reserved bit {bit}")
                for bit in range(8) if self.critical_warning & (1 << bit)]

    def describe(self) -> dict:
        return {"critical_warning": self.critical_warning, "critical_warnings": self.critical_warnings,
                "composite_c": self.composite_c, "available_spare_pct": self.available_spare_pct,
                "available_spare_threshold_pct": self.available_spare_threshold_pct,
                "percentage_used": self.percentage_used, "media_errors": self.media_errors,
                "error_log_entries": self.error_log_entries,
                "warning_temperature_minutes": self.warning_temperature_minutes,
                "critical_temperature_minutes": self.critical_temperature_minutes,
                "power_on_hours": self.power_on_hours, "unsafe_shutdowns": self.unsafe_shutdowns}


def kelvin_to_c(kelvin: int) -> float | None:
    """0 K means "not reported"; whole Kelvin become °C to two decimals (no float noise)."""
    return None if kelvin == 0 else round(kelvin - KELVIN_OFFSET, 2)


def _u128(page: bytes, offset: int) -> int:
    return int.from_bytes(page[offset:offset + 16], "little")


def parse_smart_log(page: bytes) -> SmartHealth:
    if len(page) != LOG_PAGE_BYTES:
        raise SmartLogError(f"a SMART / Health log page is {LOG_PAGE_BYTES} bytes, got {len(page)}")
    warning, composite_k, spare, spare_threshold, used, _endurance = _HEADER.unpack_from(page, 0)
    warning_minutes, critical_minutes = _TEMPERATURE_TIMES.unpack_from(page, 192)
    return SmartHealth(
        critical_warning=warning, composite_c=kelvin_to_c(composite_k), available_spare_pct=spare,
        available_spare_threshold_pct=spare_threshold, percentage_used=used,
        data_units_read=_u128(page, 32), data_units_written=_u128(page, 48), power_on_hours=_u128(page, 128),
        unsafe_shutdowns=_u128(page, 144), media_errors=_u128(page, 160), error_log_entries=_u128(page, 176),
        warning_temperature_minutes=warning_minutes, critical_temperature_minutes=critical_minutes,
        sensors_c=tuple(kelvin_to_c(k) for k in _SENSORS.unpack_from(page, 200)))
