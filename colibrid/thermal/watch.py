"""The thermal watch: the daemon's task that keeps the expert loader off a hot drive.

    start()     find the drive(s) behind the experts file (discovery), pick a SMART source
    run()       every thermal_poll_s: read temperatures (hwmon; the SMART log when hwmon is
                absent, else once a minute for health), feed the policy, apply its decision to
                the expert cache; rescan every RESCAN_INTERVAL_S; follow udev events
    status()    the `thermal` map of the status reply; status_line() the part of STATUS=

The loader's settings are owned here while the watch runs: the daemon hands over the configured
io_queue_depth and prefetch (update_settings, also on reload) and the watch applies
min(configured, policy cap), so a reload never undoes throttling and a throttle never outlives
the heat. It applies them through one callable, the engine's limit_loading: the engine
remembers them and applies them to every cache it builds later (a resize, a reopen).

udev: pyudev's netlink monitor reports add/remove/change of nvme and block devices. Without a
udev daemon (containers, our build machines) it stays silent without an error, so the periodic
rescan is what actually notices changes there. handle_event() is a plain function of (action,
device name), so tests feed it events without a monitor. A drive that disappears is reported as
missing (never as "no NVMe"): requests that need an expert read fail with `device_missing`, the
daemon keeps serving what is cached, and a rescan or an add event notices the drive's return.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from colibrid.thermal.loading_limits import LoadingLimits, LoadingPause
from colibrid.thermal.discovery import DEV_ROOT, MOUNTINFO, SYSFS_ROOT, NvmeDrive, Placement, find_drives
from colibrid.thermal.hwmon import HwmonReading, read_hwmon
from colibrid.thermal.policy import Decision, ThermalState, ThrottlePolicy, derive_thresholds
from colibrid.thermal.smart_log import SmartHealth
from colibrid.thermal.smart_source import SmartSource, SmartUnavailable, choose_smart_source

log = logging.getLogger(__name__)

RESCAN_INTERVAL_S = 60.0  # discovery again, for machines without udev events
SMART_INTERVAL_S = 60.0  # the SMART log when hwmon gives the temperatures: health changes slowly
UDEV_SUBSYSTEMS = ("nvme", "block")


@dataclass(frozen=True)
class ThermalSettings:
    """The config keys the watch uses (the daemon builds this from DaemonConfig)."""

    mode: str = "auto"  # "auto": watch the NVMe drive(s) if there are any; "off": never throttle
    poll_s: float = 5.0
    throttle: float | str = "auto"  # °C, or "auto": the drive's warning threshold - 5, else 65
    resume: float | str = "auto"  # °C, or "auto": throttle - 5
    io_queue_depth: int = 16  # as configured: the depth when not throttled
    prefetch: bool = True  # as configured


@dataclass
class _Drive:
    """One watched drive and what was last read from it."""

    drive: NvmeDrive
    present: bool = True
    smart_source: SmartSource | None = None
    smart: SmartHealth | None = None
    smart_read_s: float | None = None
    hwmon: HwmonReading | None = None
    critical_warning: int = 0  # last SMART critical-warning bits, logged once per change

    @property
    def composite_c(self) -> float | None:
        if self.hwmon is not None and self.hwmon.composite_c is not None:
            return self.hwmon.composite_c
        return self.smart.composite_c if self.smart is not None else None

    def describe(self) -> dict:
        hw = self.hwmon
        return {**self.drive.describe(), "present": self.present, "composite_c": self.composite_c,
                "sensors_c": dict(hw.sensors_c) if hw else {},
                "warning_c": hw.warning_c if hw else None, "critical_c": hw.critical_c if hw else None,
                "hwmon": str(self.drive.hwmon_dir) if self.drive.hwmon_dir else None,
                "smart_source": self.smart_source.name if self.smart_source else "none",
                "smart": self.smart.describe() if self.smart else None}


@dataclass
class _Counters:
    polls: int = 0
    read_failures: int = 0
    removals: int = 0
    returns: int = 0


class ThermalWatch:
    def __init__(self, experts_path: Path, limit_loading: Callable[[LoadingLimits], None], settings: ThermalSettings,
                 sysfs_root: Path = SYSFS_ROOT, dev_root: Path = DEV_ROOT, mountinfo: Path = MOUNTINFO,
                 clock: Callable[[], float] = time.monotonic,
                 smart_sources: Callable[[], list[SmartSource]] | None = None,
                 on_drive_back: Callable[[], None] | None = None) -> None:
        self.experts_path = Path(experts_path)
        # Called (from the rescan's thread, no lock held) when a drive that went missing is back:
        # the daemon reopens the experts file, whose old descriptor died with the device.
        self._on_drive_back = on_drive_back
        self.settings = settings
        self._limit_loading = limit_loading  # the engine's: applies to whichever source it has now
        self._sysfs_root, self._dev_root, self._mountinfo = sysfs_root, dev_root, mountinfo
        self._clock = clock
        self._smart_sources = smart_sources  # None: what this machine has (smart_source.candidate_sources)
        self._lock = threading.RLock()  # poll and rescan run on worker threads, events and status on the loop
        self._drives: list[_Drive] = []
        self._no_nvme_reason: str | None = "not scanned yet"
        self._policy = ThrottlePolicy(derive_thresholds(settings.throttle, settings.resume, None, None),
                                      settings.io_queue_depth)
        self._temperature_c: float | None = None
        self._counters = _Counters()
        self._events: asyncio.Queue[tuple[str, str]] | None = None

    # -- discovery ------------------------------------------------------------------------

    def start(self) -> None:
        """First discovery and reading. Where the experts live is logged at debug level (status
        shows it; startup logs one line); an NVMe drive without any thermometer is a warning."""
        self.rescan()
        if not self._drives:
            log.debug("%s: expert reads are not throttled", self._no_nvme_reason)
        for d in self._drives:
            drive = d.drive
            log.debug("experts file %s is on NVMe %s (%s, serial %s, firmware %s, %s-byte blocks); "
                      "temperatures from %s, SMART log from %s", self.experts_path, drive.namespace, drive.model,
                      drive.serial, drive.firmware, drive.logical_block_bytes,
                      "hwmon" if drive.hwmon_dir else "the SMART log only (no hwmon: kernel < 5.5?)",
                      d.smart_source.name if d.smart_source else "nowhere")
            if drive.hwmon_dir is None and d.smart_source is None:
                log.warning("NVMe %s has no hwmon (kernel < 5.5?) and its SMART log is not readable (needs "
                            "CAP_SYS_ADMIN): its temperature is unknown and expert reads are not throttled",
                            drive.controller)

    def rescan(self) -> None:
        """Discovery again; a drive found (or back) is read at once, not a poll interval later."""
        placement = find_drives(self.experts_path, self._sysfs_root, self._dev_root, self._mountinfo)
        with self._lock:
            known = {d.drive.controller: d.drive for d in self._drives if d.present}
        # Choosing a SMART source may run a tool for seconds: outside the lock, which status needs.
        fresh = {drive.controller: self._watch(drive) for drive in placement.drives
                 if known.get(drive.controller) != drive}
        with self._lock:
            returns_before = self._counters.returns
            found_new = self._adopt(placement, fresh)
            came_back = self._counters.returns > returns_before
        if came_back and self._on_drive_back is not None:
            self._on_drive_back()
        if found_new:
            self.poll()
        else:
            self.reconcile()

    def _adopt(self, placement: Placement, fresh: dict[str, _Drive]) -> bool:
        """A fresh discovery (``fresh``: the drives new or changed since the last one). A drive
        that was watched and is not found any more is missing — never "no NVMe, unthrottled":
        the pack did not move, its drive went away. True if a drive is new or back."""
        if not placement.drives and not self._drives:
            self._no_nvme_reason = placement.no_nvme_reason
            return False
        old = {d.drive.controller: d for d in self._drives}
        drives = []
        for drive in placement.drives:
            kept = old.get(drive.controller)
            if drive.controller not in fresh and kept is not None:
                drives.append(kept)
                continue
            if kept is not None and not kept.present:
                self._counters.returns += 1
                log.warning("NVMe %s (%s) is back", drive.controller, drive.model)
            drives.append(fresh.get(drive.controller) or self._watch(drive))  # (or: another rescan raced us)
        found = {drive.controller for drive in placement.drives}
        for controller, d in old.items():
            if controller not in found:
                self._mark_missing(d)
                drives.append(d)
        self._drives, self._no_nvme_reason = drives, None
        return bool(fresh)

    def _watch(self, drive: NvmeDrive) -> _Drive:
        sources = self._smart_sources() if self._smart_sources is not None else None
        source, smart, failures = choose_smart_source(drive.char_device, sources)
        for failure in failures:
            log.debug("SMART log of %s: %s", drive.controller, failure)
        if source is None:
            log.debug("SMART log of %s not readable (%s): temperatures from hwmon only", drive.controller,
                     "; ".join(failures) or "no source")
        watched = _Drive(drive, smart_source=source)
        if smart is not None:
            self._note_smart(watched, smart)
        return watched

    def _mark_missing(self, d: _Drive) -> None:
        if d.present:
            d.present = False
            self._counters.removals += 1
            log.warning("NVMe %s (%s) holding %s is gone: reads that need it fail until it returns",
                        d.drive.controller, d.drive.model, self.experts_path)

    def handle_event(self, action: str, device_name: str) -> None:
        """One udev event (pyudev's device.action and device.sys_name). A removal of a watched
        controller, namespace or partition marks the drive missing at once; any added nvme or
        block device may be our drive coming back (perhaps under a new name), and a change of
        ours may change what it is: rescan."""
        with self._lock:
            watched = [d for d in self._drives
                       if device_name in (d.drive.controller, d.drive.namespace, d.drive.block_device)]
            if action == "remove":
                for d in watched:
                    self._mark_missing(d)
        if action == "remove":
            self.reconcile()
        elif action == "add" or (action == "change" and watched):
            self.rescan()

    # -- polling --------------------------------------------------------------------------

    def poll(self) -> None:
        """Read every present drive, feed the hottest composite temperature to the policy, apply."""
        if self.settings.mode == "off":
            self.reconcile()
            return
        with self._lock:
            drives = [d for d in self._drives if d.present]
        if not drives:  # not on NVMe, or every drive gone: nothing to read
            self._temperature_c = None
            self.reconcile()
            return
        for d in drives:
            self._read(d)
        with self._lock:
            self._counters.polls += 1
            temperatures = [d.composite_c for d in self._drives if d.present and d.composite_c is not None]
            self._temperature_c = max(temperatures) if temperatures else None
            if self._temperature_c is not None:
                self._update_thresholds()
                before = self._policy.decision()
                decision, transition = self._policy.observe(self._temperature_c, self._clock())
                self._log_decision(before, decision, transition)
        self.reconcile()

    def _read(self, d: _Drive) -> None:
        now = self._clock()
        if d.drive.hwmon_dir is not None:
            try:
                d.hwmon = read_hwmon(d.drive.hwmon_dir)
            except FileNotFoundError:
                with self._lock:
                    self._mark_missing(d)
                return
            except OSError as exc:
                self._counters.read_failures += 1
                log.warning("reading the temperatures of %s failed: %s", d.drive.controller, exc)
                d.hwmon = None
        smart_due = d.smart_read_s is None or now - d.smart_read_s >= SMART_INTERVAL_S
        if d.smart_source is not None and (d.drive.hwmon_dir is None or smart_due):
            try:
                self._note_smart(d, d.smart_source.read(d.drive.char_device))
            except SmartUnavailable as exc:
                self._counters.read_failures += 1
                log.warning("reading the SMART log of %s failed: %s", d.drive.controller, exc)
            except ValueError as exc:  # a page that does not parse
                self._counters.read_failures += 1
                log.warning("the SMART log of %s is malformed: %s", d.drive.controller, exc)

    def _note_smart(self, d: _Drive, smart: SmartHealth) -> None:
        d.smart, d.smart_read_s = smart, self._clock()
        if smart.critical_warning != d.critical_warning:
            words = ", ".join(smart.critical_warnings) or "none"
            log.warning("NVMe %s SMART critical warning changed from %#04x to %#04x: %s", d.drive.controller,
                        d.critical_warning, smart.critical_warning, words)
            d.critical_warning = smart.critical_warning

    def _update_thresholds(self) -> None:
        """Thresholds from the settings and the drives' own limits: the most careful drive wins."""
        warnings = [d.hwmon.warning_c for d in self._drives if d.hwmon and d.hwmon.warning_c]
        criticals = [d.hwmon.critical_c for d in self._drives if d.hwmon and d.hwmon.critical_c]
        thresholds = derive_thresholds(self.settings.throttle, self.settings.resume,
                                       min(warnings) if warnings else None, min(criticals) if criticals else None)
        if thresholds != self._policy.thresholds:
            log.debug("thermal thresholds: throttle at %g °C, resume at %g °C, critical at %g °C",
                     thresholds.throttle_c, thresholds.resume_c, thresholds.critical_c)
            self._policy.thresholds = thresholds

    def _log_decision(self, before: Decision, after: Decision, transition: str | None) -> None:
        t = self._temperature_c
        if transition is not None:
            level = logging.INFO if after.state is ThermalState.NORMAL else logging.WARNING
            log.log(level, "thermal %s at %g °C: %s", transition, t, self._describe_decision(after))
        elif after.depth_cap != before.depth_cap:
            log.info("still at %g °C: %s", t, self._describe_decision(after))

    def _describe_decision(self, decision: Decision) -> str:
        if decision.state is ThermalState.NORMAL:
            return f"{self.settings.io_queue_depth} reads in flight, prefetch as configured"
        if decision.loading_paused:
            return "expert loading paused; cached experts keep serving"
        depth = min(decision.depth_cap or self.settings.io_queue_depth, self.settings.io_queue_depth)
        return f"{depth} reads in flight, prefetch paused"

    # -- applying -------------------------------------------------------------------------

    def update_settings(self, settings: ThermalSettings) -> None:
        """New config (start or reload); applied at once to the expert source."""
        with self._lock:
            self.settings = settings
            self._policy.full_depth = settings.io_queue_depth
            self._update_thresholds()
        self.reconcile()

    def _wanted(self) -> LoadingLimits:
        """How the expert source should read now."""
        s = self.settings
        with self._lock:
            if s.mode == "off" or not self._drives:
                return LoadingLimits(s.io_queue_depth, s.prefetch, None)
            missing = [d.drive.controller for d in self._drives if not d.present]
            decision = self._policy.decision()
            depth = s.io_queue_depth if decision.depth_cap is None else min(decision.depth_cap, s.io_queue_depth)
            prefetch = s.prefetch and not decision.prefetch_paused and not missing
            pause = None
            if missing:
                pause = LoadingPause("device_missing", f"the NVMe drive {', '.join(missing)} holding "
                                                       f"{self.experts_path} was removed")
            elif decision.loading_paused:
                pause = LoadingPause("thermal", f"the NVMe drive is at {self._temperature_c:g} °C "
                                                f"(critical threshold {self._policy.thresholds.critical_c:g} °C)")
            return LoadingLimits(depth, prefetch, pause)

    def reconcile(self) -> None:
        """Hand what is wanted now to the engine (which changes only what differs)."""
        self._limit_loading(self._wanted())

    # -- the daemon's task -------------------------------------------------------------------

    async def run(self) -> None:
        """Poll, rescan and follow udev until cancelled. Blocking reads (sysfs files make the
        drive answer a command; a SMART tool may take seconds) run on a worker thread."""
        loop = asyncio.get_running_loop()
        self._events = asyncio.Queue()
        monitor = self._open_monitor()
        if monitor is not None:
            loop.add_reader(monitor.fileno(), self._drain_monitor, monitor)
        next_poll = next_rescan = self._clock()
        try:
            while True:
                now = self._clock()
                if now >= next_rescan:
                    await asyncio.to_thread(self.rescan)
                    next_rescan = now + RESCAN_INTERVAL_S
                if now >= next_poll:
                    await asyncio.to_thread(self.poll)
                    next_poll = now + self.settings.poll_s
                timeout = max(0.0, min(next_poll, next_rescan) - self._clock())
                try:
                    action, name = await asyncio.wait_for(self._events.get(), timeout)
                except asyncio.TimeoutError:
                    continue
                await asyncio.to_thread(self.handle_event, action, name)
        finally:
            if monitor is not None:
                loop.remove_reader(monitor.fileno())

    def _open_monitor(self):
        """pyudev's netlink monitor of nvme and block devices, or None (logged) if there is none."""
        try:
            import pyudev

            monitor = pyudev.Monitor.from_netlink(pyudev.Context())
            for subsystem in UDEV_SUBSYSTEMS:
                monitor.filter_by(subsystem)
            monitor.start()
        except Exception as exc:  # no netlink (sandbox), no libudev: the rescan still works
            log.info("no udev event monitor (%s); rescanning every %.0f s instead", exc, RESCAN_INTERVAL_S)
            return None
        return monitor

    def _drain_monitor(self, monitor) -> None:
        while (device := monitor.poll(timeout=0)) is not None:
            if self._events is not None:
                self._events.put_nowait((device.action or "", device.sys_name))

    # -- what it says -----------------------------------------------------------------------

    def _state_name(self) -> str:
        if self.settings.mode == "off":
            return "off"
        if not self._drives:
            return "unthrottled"
        if any(not d.present for d in self._drives):
            return "device_missing"
        if self._temperature_c is None:
            return "no_temperature"
        return self._policy.state.value

    def status(self) -> dict:
        """The `thermal` map of the status reply (docs/protocol.md)."""
        with self._lock:
            wanted = self._wanted()
            depth, prefetch, pause = wanted.io_queue_depth, wanted.prefetch, wanted.pause
            now = self._clock()
            policy = self._policy
            return {
                "state": self._state_name(),
                "reason": self._no_nvme_reason if not self._drives else None,
                "temperature_c": self._temperature_c,
                **policy.thresholds.describe(),
                "io_queue_depth": depth,
                "prefetch_paused": self.settings.prefetch and not prefetch,
                "loading_paused": pause.reason if pause else None,
                "throttled_s": policy.time_in(ThermalState.THROTTLED, now) + policy.time_in(ThermalState.CRITICAL, now),
                "critical_s": policy.time_in(ThermalState.CRITICAL, now),
                "transitions": dict(policy.transitions),
                "poll_s": self.settings.poll_s,
                "polls": self._counters.polls,
                "read_failures": self._counters.read_failures,
                "removals": self._counters.removals,
                "returns": self._counters.returns,
                "drives": [d.describe() for d in self._drives],
            }

    def status_line(self) -> str:
        """The thermal part of STATUS=: short, and says plainly when nothing is throttled."""
        with self._lock:
            state = self._state_name()
            if state == "off":
                return "thermal watch off"
            if state == "unthrottled":
                return "no NVMe device, unthrottled"
            names = "+".join(d.drive.controller for d in self._drives)
            if state == "device_missing":
                return f"{names} REMOVED: expert loading paused"
            if state == "no_temperature":
                return f"{names}: no temperature source, unthrottled"
            t = f"{names} {self._temperature_c:g} °C"
            if state == "critical":
                return f"{t} CRITICAL: expert loading paused"
            if state == "throttled":
                return f"{t} throttled: {self._wanted().io_queue_depth} reads in flight, prefetch paused"
            return t
