"""The throttle policy alone: thresholds from the config and the drive, and the state machine
normal -> throttled (halving the reads in flight each hot poll) -> critical -> resumed."""

from __future__ import annotations

import pytest

from colibrid.thermal.policy import ThermalState, Thresholds, ThrottlePolicy, derive_thresholds


@pytest.mark.parametrize("settings, warning_c, critical_c, expected", [
    (("auto", "auto"), 82.0, 85.0, Thresholds(77.0, 72.0, 85.0)),  # the drive's warning threshold - 5
    (("auto", "auto"), None, None, Thresholds(65.0, 60.0, 80.0)),  # nothing known: 65 °C, critical 80
    (("auto", "auto"), 95.0, 84.0, Thresholds(79.0, 74.0, 84.0)),  # a warning above critical: still before it
    ((70, "auto"), 82.0, 85.0, Thresholds(70.0, 65.0, 85.0)),
    ((70, 60), None, 90.0, Thresholds(70.0, 60.0, 90.0)),
    ((70, 75), None, None, Thresholds(70.0, 70.0, 80.0)),  # resume never above throttle
])
def test_thresholds(settings, warning_c, critical_c, expected):
    assert derive_thresholds(*settings, warning_c, critical_c) == expected


def test_a_heat_wave_from_normal_to_critical_and_back():
    policy = ThrottlePolicy(Thresholds(throttle_c=70, resume_c=65, critical_c=80), full_depth=16)
    steps = [
        # (°C, state, cap, prefetch paused, loading paused, transition)
        (50, "normal", None, False, False, None),
        (70, "throttled", 8, True, False, "normal->throttled"),
        (72, "throttled", 4, True, False, None),  # still hot: halve again
        (68, "throttled", 4, True, False, None),  # between resume and throttle: hold
        (71, "throttled", 2, True, False, None),
        (71, "throttled", 1, True, False, None),
        (75, "throttled", 1, True, False, None),  # never below one read
        (80, "critical", 1, True, True, "throttled->critical"),
        (78, "critical", 1, True, True, None),  # hysteresis: 3 °C below critical to leave
        (76, "throttled", 1, True, False, "critical->throttled"),
        (66, "throttled", 1, True, False, None),
        (65, "normal", None, False, False, "throttled->normal"),
    ]
    for now_s, (t, state, cap, prefetch_paused, loading_paused, transition) in enumerate(steps):
        decision, happened = policy.observe(t, float(now_s))
        assert (decision.state.value, decision.depth_cap, decision.prefetch_paused, decision.loading_paused,
                happened) == (state, cap, prefetch_paused, loading_paused, transition), f"at {t} °C"
    assert policy.transitions == {"normal->throttled": 1, "throttled->critical": 1, "critical->throttled": 1,
                                  "throttled->normal": 1}
    assert policy.time_in(ThermalState.THROTTLED, 11.0) == 8.0  # from second 1 to 7, and 9 to 11
    assert policy.time_in(ThermalState.CRITICAL, 11.0) == 2.0


def test_a_jump_straight_to_critical_leaves_it_throttled():
    policy = ThrottlePolicy(Thresholds(throttle_c=70, resume_c=65, critical_c=80), full_depth=16)
    assert policy.observe(50, 0.0)[0].state is ThermalState.NORMAL
    assert policy.observe(85, 1.0)[0].state is ThermalState.CRITICAL
    decision, transition = policy.observe(74, 2.0)
    assert (decision.state, decision.depth_cap, decision.prefetch_paused, transition) == (
        ThermalState.THROTTLED, 8, True, "critical->throttled")


def test_the_cap_follows_a_lower_configured_depth():
    policy = ThrottlePolicy(Thresholds(70, 65, 80), full_depth=32)
    assert policy.observe(75, 0.0)[0].depth_cap == 16
    policy.full_depth = 4  # a reload lowered io_queue_depth while throttled
    assert policy.decision().depth_cap == 4
