"""Where the SMART / Health log page comes from, best first:

    ioctl      NVME_IOCTL_ADMIN_CMD Get Log Page on the controller's character device. The
               kernel allows admin Get Log Page only with CAP_SYS_ADMIN (the shipped unit does
               not grant it: docs/thermal.md says why).
    nvme-cli   `nvme smart-log DEV -o binary`: the same raw 512 bytes, parsed by us.
    smartctl   `smartctl -j -A DEV`: smartmontools' JSON of the same fields (temperatures in °C).
    none       hwmon alone: temperatures and limits, no health counters.

The tools help where they run with more privilege than we do (sudo rules, setcap); without it
they fail the same way the ioctl does, and the next source is tried. The choice is made once per
drive discovery and shown in status.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Protocol

from colibrid.thermal.smart_log import LOG_PAGE_BYTES, SmartHealth, SmartLogError, parse_smart_log

log = logging.getLogger(__name__)

TOOL_TIMEOUT_S = 10.0
SMART_LOG_ID = 0x02
ADMIN_GET_LOG_PAGE = 0x02
NSID_ALL = 0xFFFFFFFF  # the controller-wide log page


class NvmeAdminCommand(ctypes.Structure):
    """struct nvme_passthru_cmd (alias nvme_admin_cmd) of <linux/nvme_ioctl.h>."""

    _fields_ = [("opcode", ctypes.c_uint8), ("flags", ctypes.c_uint8), ("rsvd1", ctypes.c_uint16),
                ("nsid", ctypes.c_uint32), ("cdw2", ctypes.c_uint32), ("cdw3", ctypes.c_uint32),
                ("metadata", ctypes.c_uint64), ("addr", ctypes.c_uint64), ("metadata_len", ctypes.c_uint32),
                ("data_len", ctypes.c_uint32), ("cdw10", ctypes.c_uint32), ("cdw11", ctypes.c_uint32),
                ("cdw12", ctypes.c_uint32), ("cdw13", ctypes.c_uint32), ("cdw14", ctypes.c_uint32),
                ("cdw15", ctypes.c_uint32), ("timeout_ms", ctypes.c_uint32), ("result", ctypes.c_uint32)]


assert ctypes.sizeof(NvmeAdminCommand) == 72, "struct nvme_passthru_cmd is 72 bytes"
# _IOWR('N', 0x41, struct nvme_admin_cmd): direction 3 (read|write), size, type 'N', number 0x41.
NVME_IOCTL_ADMIN_CMD = (3 << 30) | (ctypes.sizeof(NvmeAdminCommand) << 16) | (ord("N") << 8) | 0x41


class SmartUnavailable(Exception):
    """This source cannot read the log page here (no privilege, no tool, device gone)."""


class SmartSource(Protocol):
    name: str

    def read(self, char_device: Path) -> SmartHealth: ...


def get_log_page_command(buffer: ctypes.Array) -> NvmeAdminCommand:
    """Get Log Page, SMART / Health, whole page into ``buffer`` (512 bytes)."""
    dwords = len(buffer) // 4
    return NvmeAdminCommand(opcode=ADMIN_GET_LOG_PAGE, nsid=NSID_ALL, addr=ctypes.addressof(buffer),
                            data_len=len(buffer), cdw10=((dwords - 1) << 16) | SMART_LOG_ID)


class IoctlSmartSource:
    name = "ioctl"

    def read(self, char_device: Path) -> SmartHealth:
        buffer = ctypes.create_string_buffer(LOG_PAGE_BYTES)
        command = get_log_page_command(buffer)
        try:
            fd = os.open(char_device, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise SmartUnavailable(f"cannot open {char_device}: {exc.strerror}") from None
        try:
            status = fcntl.ioctl(fd, NVME_IOCTL_ADMIN_CMD, command)
        except OSError as exc:
            hint = " (needs CAP_SYS_ADMIN)" if exc.errno in (errno.EACCES, errno.EPERM) else ""
            raise SmartUnavailable(f"Get Log Page on {char_device}: {exc.strerror}{hint}") from None
        finally:
            os.close(fd)
        if status != 0:
            raise SmartUnavailable(f"Get Log Page on {char_device}: NVMe status {status:#x}")
        return parse_smart_log(buffer.raw)


def _run_tool(argv: list[str]) -> bytes:
    try:
        done = subprocess.run(argv, capture_output=True, timeout=TOOL_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SmartUnavailable(f"{' '.join(argv)}: {exc}") from None
    if done.returncode != 0:
        first_line = done.stderr.decode(errors="replace").strip().splitlines()[:1]
        raise SmartUnavailable(f"{' '.join(argv)} exited with {done.returncode}: {''.join(first_line)}")
    return done.stdout


class NvmeCliSmartSource:
    name = "nvme-cli"

    def __init__(self, executable: str) -> None:
        self.executable = executable

    def read(self, char_device: Path) -> SmartHealth:
        page = _run_tool([self.executable, "smart-log", str(char_device), "-o", "binary"])
        try:
            return parse_smart_log(page)
        except SmartLogError as exc:
            raise SmartUnavailable(f"nvme smart-log: {exc}") from None


def smart_health_from_smartctl(report: dict) -> SmartHealth:
    """SmartHealth from `smartctl -j` output (its nvme_smart_health_information_log, in °C)."""
    log_page = report.get("nvme_smart_health_information_log")
    if not isinstance(log_page, dict):
        raise SmartUnavailable("smartctl printed no nvme_smart_health_information_log")
    sensors = [float(t) for t in log_page.get("temperature_sensors", [])][:8]
    value = lambda key: int(log_page.get(key, 0))  # noqa: E731 - absent counters read as 0
    return SmartHealth(
        critical_warning=value("critical_warning"),
        composite_c=float(log_page["temperature"]) if "temperature" in log_page else None,
        available_spare_pct=value("available_spare"), available_spare_threshold_pct=value("available_spare_threshold"),
        percentage_used=value("percentage_used"), data_units_read=value("data_units_read"),
        data_units_written=value("data_units_written"), power_on_hours=value("power_on_hours"),
        unsafe_shutdowns=value("unsafe_shutdowns"), media_errors=value("media_errors"),
        error_log_entries=value("num_err_log_entries"), warning_temperature_minutes=value("warning_temp_time"),
        critical_temperature_minutes=value("critical_comp_time"),
        sensors_c=tuple(sensors) + (None,) * (8 - len(sensors)))


class SmartctlSmartSource:
    name = "smartctl"

    def __init__(self, executable: str) -> None:
        self.executable = executable

    def read(self, char_device: Path) -> SmartHealth:
        output = _run_tool([self.executable, "-j", "-A", str(char_device)])
        try:
            return smart_health_from_smartctl(json.loads(output))
        except (ValueError, TypeError) as exc:
            raise SmartUnavailable(f"smartctl -j: unreadable output ({exc})") from None


def candidate_sources() -> list[SmartSource]:
    """Every source this machine could use, best first (tools only if installed)."""
    sources: list[SmartSource] = [IoctlSmartSource()]
    if nvme := shutil.which("nvme"):
        sources.append(NvmeCliSmartSource(nvme))
    if smartctl := shutil.which("smartctl"):
        sources.append(SmartctlSmartSource(smartctl))
    return sources


def choose_smart_source(char_device: Path, sources: list[SmartSource] | None = None) -> tuple[SmartSource | None, SmartHealth | None, list[str]]:
    """The first source that reads ``char_device``, its first reading, and why each better one
    failed (for the log: a fallback is never silent)."""
    failures = []
    for source in candidate_sources() if sources is None else sources:
        try:
            return source, source.read(char_device), failures
        except SmartUnavailable as exc:
            failures.append(f"{source.name}: {exc}")
    return None, None, failures
