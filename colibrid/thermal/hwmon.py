"""An NVMe controller's temperatures from its hwmon directory in sysfs (Linux >= 5.5).

    temp1_input  Composite temperature, millidegrees Celsius (what the drive throttles on)
    temp1_max    the over-temperature threshold, by default the drive's warning threshold (WCTEMP)
    temp1_crit   the critical threshold (CCTEMP)
    temp1_alarm  1 while the composite temperature is beyond a threshold
    tempN_input  Sensor N-1, with tempN_label "Sensor N-1" (N >= 2)

No privilege is needed, which makes hwmon the primary source. Each read makes the drive answer
a Get Log Page or Get Features command, so this is polled every few seconds, never in a loop;
and each poll opens the files again (pyudev would hand back values cached per device object).
"""

from __future__ import annotations

import errno
import re
from dataclasses import dataclass, field
from pathlib import Path

_TEMP_INPUT = re.compile(r"temp(\d+)_input$")


@dataclass(frozen=True)
class HwmonReading:
    composite_c: float | None
    sensors_c: dict[str, float] = field(default_factory=dict)  # label -> °C, the composite excluded
    warning_c: float | None = None  # temp1_max
    critical_c: float | None = None  # temp1_crit
    alarm: bool | None = None  # temp1_alarm


# The controller did not answer (or is going away): the caller decides what that means.
_DEVICE_ERRNOS = (errno.EIO, errno.ENXIO, errno.ENODEV)


def _integer(directory: Path, name: str) -> int | None:
    """An integer attribute; None if absent or unreadable (not every drive has every limit)."""
    try:
        return int((directory / name).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    except OSError as exc:
        if exc.errno in _DEVICE_ERRNOS:
            raise
        return None


def _millidegrees(directory: Path, name: str) -> float | None:
    value = _integer(directory, name)
    return None if value is None else value / 1000.0


def read_hwmon(hwmon_dir: Path) -> HwmonReading:
    """One fresh reading. Raises FileNotFoundError if the hwmon directory is gone (the drive was
    removed) and OSError if the controller does not answer."""
    if not hwmon_dir.is_dir():
        raise FileNotFoundError(f"{hwmon_dir} is gone")
    sensors: dict[str, float] = {}
    composite = None
    for entry in sorted(hwmon_dir.iterdir(), key=lambda p: p.name):
        match = _TEMP_INPUT.match(entry.name)
        if not match:
            continue
        index = int(match.group(1))
        value = _millidegrees(hwmon_dir, entry.name)
        if value is None:
            continue
        if index == 1:
            composite = value
        else:
            label = (hwmon_dir / f"temp{index}_label")
            sensors[label.read_text().strip() if label.exists() else f"Sensor {index - 1}"] = value
    alarm = _integer(hwmon_dir, "temp1_alarm")
    return HwmonReading(composite_c=composite, sensors_c=sensors, warning_c=_millidegrees(hwmon_dir, "temp1_max"),
                        critical_c=_millidegrees(hwmon_dir, "temp1_crit"),
                        alarm=None if alarm is None else alarm != 0)
