"""The thermal watch on a fake sysfs tree, driving a real expert cache: its loader's queue
depth, its prefetch and its loading gate at every step of a heat wave; removal and return of
the drive by udev events; plain "no NVMe device" where there is none."""

from __future__ import annotations

import logging

import pytest

from colibrid.engine.experts.source import ExpertLoadingPaused
from colibrid.thermal.smart_log import parse_smart_log
from colibrid.thermal.watch import ThermalSettings, ThermalWatch
from tests.thermal.fake_sysfs import file_dev
from tests.thermal.test_smart_log import RECORDED_PAGE


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def make_watch(sysfs, source, clock=None, smart_sources=(), on_drive_back=None, **settings) -> ThermalWatch:
    watch = ThermalWatch(source.path, limiter(source), ThermalSettings(io_queue_depth=16, prefetch=True, **settings),
                         sysfs_root=sysfs.sys, dev_root=sysfs.dev, clock=clock or FakeClock(),
                         smart_sources=lambda: list(smart_sources), on_drive_back=on_drive_back)
    watch.start()
    return watch


def limiter(source):
    """What the engine's limit_loading does to its source."""
    from colibrid.engine.experts.source import apply_loading_limits

    return lambda limits: apply_loading_limits(source, limits)


def loader_state(source) -> tuple[int, bool, str | None]:
    """What the cache really does now: reads in flight (the C loader's), prefetch, and the gate."""
    pause = source.loading_pause
    return source.backing_info()["io_queue_depth"], source.prefetch_enabled, pause.code if pause else None


def test_a_heat_wave_throttles_the_loader_then_pauses_loading_then_restores_it(sysfs, expert_source):
    fake = sysfs.add_nvme(file_dev(expert_source.path), warning_c=82.0, critical_c=85.0, composite_c=45.0)
    clock = FakeClock()
    watch = make_watch(sysfs, expert_source, clock)  # throttle 77 (warning - 5), resume 72, critical 85
    cached = expert_source.get(0, 3)  # in the cache before the heat
    steps = [
        # (°C, thermal state, reads in flight, prefetch, loading gate)
        (45.0, "normal", 16, True, None),
        (77.5, "throttled", 8, False, None),
        (79.0, "throttled", 4, False, None),
        (74.0, "throttled", 4, False, None),  # between resume and throttle: held
        (85.2, "critical", 4, False, "thermal"),
        (83.0, "critical", 4, False, "thermal"),  # within the 3 °C hysteresis
        (81.0, "throttled", 4, False, None),
        (72.0, "normal", 16, True, None),
    ]
    for t, state, depth, prefetch, gate in steps:
        sysfs.set_temperature(fake, t)
        clock.now_s += 5.0
        watch.poll()
        status = watch.status()
        assert (status["state"], status["temperature_c"]) == (state, t)
        assert loader_state(expert_source) == (depth, prefetch, gate), f"at {t} °C"
        assert status["io_queue_depth"] == depth and status["prefetch_paused"] is (not prefetch)
        if state == "critical":
            # A step that needs a read fails with the thermal code; cached experts keep serving.
            with pytest.raises(ExpertLoadingPaused) as refused:
                with expert_source.acquire(1, [5, 6]):
                    pass
            assert refused.value.code == "thermal" and "85 °C" in str(refused.value)
            assert expert_source.prefetch(1, [7, 8]) == 0
            with expert_source.acquire(0, [3]) as weights:
                assert weights[3].gate.data.tobytes() == cached.gate.data.tobytes()
    status = watch.status()
    assert status["transitions"] == {"normal->throttled": 1, "throttled->critical": 1, "critical->throttled": 1,
                                     "throttled->normal": 1}
    assert status["throttled_s"] == 30.0 and status["critical_s"] == 10.0
    assert (status["throttle_c"], status["resume_c"], status["critical_c"]) == (77.0, 72.0, 85.0)
    with expert_source.acquire(1, [5, 6]):  # loading again
        pass


def test_status_names_the_drive_and_its_readings(sysfs, expert_source):
    fake = sysfs.add_nvme(file_dev(expert_source.path), composite_c=50.0)
    watch = make_watch(sysfs, expert_source)
    status = watch.status()
    (drive,) = status["drives"]
    assert drive["controller"] == "nvme0" and drive["model"] == "Fake NVMe 980 PRO 1TB"
    assert drive["serial"] == "S5GXNF0R123456" and drive["firmware"] == "5B2QGXA7"
    assert drive["logical_block_bytes"] == 512 and drive["present"] is True
    assert drive["composite_c"] == 50.0 and drive["sensors_c"] == {"Sensor 1": 53.0, "Sensor 2": 48.0}
    assert (drive["warning_c"], drive["critical_c"]) == (82.0, 85.0)
    assert drive["smart_source"] == "none" and drive["smart"] is None
    assert watch.status_line() == "nvme0 50 °C"
    sysfs.set_temperature(fake, 78.0)
    watch.poll()
    assert watch.status_line() == "nvme0 78 °C throttled: 8 reads in flight, prefetch paused"


def test_a_reload_while_throttled_keeps_the_throttle(sysfs, expert_source):
    fake = sysfs.add_nvme(file_dev(expert_source.path), composite_c=78.0)
    watch = make_watch(sysfs, expert_source)
    assert loader_state(expert_source) == (8, False, None)
    watch.update_settings(ThermalSettings(io_queue_depth=4, prefetch=True))
    assert loader_state(expert_source) == (4, False, None)  # min(new depth, the cap)
    watch.update_settings(ThermalSettings(io_queue_depth=32, prefetch=True))
    assert loader_state(expert_source) == (8, False, None)
    sysfs.set_temperature(fake, 60.0)
    watch.poll()
    assert loader_state(expert_source) == (32, True, None)


def test_thermal_off_never_throttles(sysfs, expert_source):
    sysfs.add_nvme(file_dev(expert_source.path), composite_c=90.0)
    watch = make_watch(sysfs, expert_source, mode="off")
    assert loader_state(expert_source) == (16, True, None)
    assert watch.status()["state"] == "off" and watch.status_line() == "thermal watch off"


def test_removal_and_return_by_udev_events(sysfs, expert_source):
    fake = sysfs.add_nvme(file_dev(expert_source.path), composite_c=45.0)
    returns = []  # the daemon reopens the experts file here: the old descriptor died with the device
    watch = make_watch(sysfs, expert_source, on_drive_back=lambda: returns.append(watch.status()["returns"]))
    expert_source.get(0, 1)

    saved = sysfs.remove_nvme(fake)
    watch.handle_event("remove", "nvme0n1p1")
    status = watch.status()
    assert status["state"] == "device_missing" and status["drives"][0]["present"] is False
    assert status["removals"] == 1 and watch.status_line() == "nvme0 REMOVED: expert loading paused"
    assert loader_state(expert_source) == (16, False, "device_missing")
    with pytest.raises(ExpertLoadingPaused) as refused:
        expert_source.get(2, 9)
    assert refused.value.code == "device_missing" and "nvme0" in str(refused.value)
    with expert_source.acquire(0, [1]):  # cached: still served
        pass
    watch.poll()  # polling a missing drive neither fails nor forgets it
    watch.rescan()
    assert watch.status()["state"] == "device_missing" and returns == []

    sysfs.add_back(fake, saved)
    watch.handle_event("add", "nvme0")
    watch.poll()
    status = watch.status()
    assert status["state"] == "normal" and status["drives"][0]["present"] is True and status["returns"] == 1
    assert loader_state(expert_source) == (16, True, None)
    assert returns == [1]  # called once, when the drive was back


def test_the_periodic_rescan_notices_a_removal_without_udev(sysfs, expert_source):
    """Without a udev daemon no event ever comes: the poll and the rescan must see it."""
    fake = sysfs.add_nvme(file_dev(expert_source.path))
    watch = make_watch(sysfs, expert_source)
    saved = sysfs.remove_nvme(fake)
    watch.poll()  # its hwmon is gone
    assert watch.status()["state"] == "device_missing"
    sysfs.add_back(fake, saved)
    watch.rescan()
    assert watch.status()["state"] == "normal"


def test_events_for_other_devices_change_nothing(sysfs, expert_source):
    sysfs.add_nvme(file_dev(expert_source.path))
    watch = make_watch(sysfs, expert_source)
    watch.handle_event("remove", "sdb")
    watch.handle_event("add", "nvme7")
    assert watch.status()["state"] == "normal" and watch.status()["removals"] == 0


def test_a_pack_not_on_nvme_runs_unthrottled_and_says_so(sysfs, expert_source):
    sysfs.add_virtio_disk(file_dev(expert_source.path))
    watch = make_watch(sysfs, expert_source)
    status = watch.status()
    assert status["state"] == "unthrottled" and status["drives"] == []
    assert status["reason"] == f"no NVMe device: {expert_source.path} is on vda (virtio_blk)"
    assert watch.status_line() == "no NVMe device, unthrottled"
    assert loader_state(expert_source) == (16, True, None)


class ScriptedSmartSource:
    """Hands out SMART pages whose critical-warning byte the test sets."""

    name = "scripted"

    def __init__(self) -> None:
        self.critical_warning = 0

    def read(self, char_device):
        page = bytearray(RECORDED_PAGE.read_bytes())
        page[0] = self.critical_warning
        return parse_smart_log(bytes(page))


def test_smart_critical_warnings_are_logged_once_per_change(sysfs, expert_source, caplog):
    sysfs.add_nvme(file_dev(expert_source.path), hwmon=None)  # no hwmon: the SMART log is the thermometer
    smart = ScriptedSmartSource()
    clock = FakeClock()
    with caplog.at_level(logging.WARNING, logger="colibrid.thermal.watch"):
        watch = make_watch(sysfs, expert_source, clock, smart_sources=[smart])
        for bits in (0, 0, 0x02, 0x02, 0x02, 0x06, 0):
            smart.critical_warning = bits
            clock.now_s += 5.0
            watch.poll()
    changes = [r.getMessage() for r in caplog.records if "critical warning" in r.getMessage()]
    assert changes == [
        "NVMe nvme0 SMART critical warning changed from 0x00 to 0x02: temperature beyond a threshold",
        "NVMe nvme0 SMART critical warning changed from 0x02 to 0x06: temperature beyond a threshold, "
        "reliability degraded (media or internal errors)",
        "NVMe nvme0 SMART critical warning changed from 0x06 to 0x00: none",
    ]
    status = watch.status()
    assert status["drives"][0]["smart_source"] == "scripted"
    assert status["temperature_c"] == 69.85  # the SMART composite temperature, hwmon being absent
    assert status["drives"][0]["smart"]["media_errors"] == 2


def test_the_daemon_task_polls_and_follows_queued_udev_events(sysfs, expert_source):
    """run() as the daemon runs it: polls on its own, and an event from the monitor (queued
    here by hand: this machine has no udev daemon) reaches handle_event."""
    import asyncio

    fake = sysfs.add_nvme(file_dev(expert_source.path), composite_c=45.0)
    watch = ThermalWatch(expert_source.path, limiter(expert_source), ThermalSettings(poll_s=0.05),
                         sysfs_root=sysfs.sys, dev_root=sysfs.dev, smart_sources=lambda: [])
    watch.start()

    async def scenario():
        task = asyncio.create_task(watch.run())
        try:
            sysfs.set_temperature(fake, 80.0)
            await _until(lambda: watch.status()["state"] == "throttled")
            watch.update_settings(ThermalSettings(poll_s=600.0))  # from now on only the event can tell
            await asyncio.sleep(0.2)
            sysfs.remove_nvme(fake)
            watch._events.put_nowait(("remove", "nvme0"))
            await _until(lambda: watch.status()["state"] == "device_missing")
        finally:
            task.cancel()

    asyncio.run(scenario())
    assert loader_state(expert_source)[2] == "device_missing"


async def _until(condition, timeout_s: float = 5.0) -> None:
    import asyncio

    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")
