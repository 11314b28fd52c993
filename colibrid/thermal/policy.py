"""Temperature -> how hard Colibri may read from the drive. Pure: no I/O, no clock of its own.

    NORMAL     the configured io_queue_depth and prefetch
    THROTTLED  entered at >= throttle_c; prefetch paused and the reads in flight halved at every
               poll still at or above throttle_c (16 -> 8 -> 4 ... down to 1); held between
               resume_c and throttle_c (hysteresis: no flapping at the threshold); left for
               NORMAL, everything restored, at <= resume_c
    CRITICAL   entered at >= critical_c: expert loading paused, so a request that needs an
               expert not in the cache fails with a `thermal` error while cached experts keep
               serving; left for THROTTLED (at its lowest depth) below critical_c - CRITICAL_HYSTERESIS_C

The drive throttles itself on its composite temperature; so does this policy. Time spent in
each state and every transition are counted here, for status.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

DEFAULT_THROTTLE_C = 65.0  # when the drive does not expose its warning threshold
WARNING_MARGIN_C = 5.0  # throttle this far below the drive's warning threshold, before the drive does
RESUME_BELOW_THROTTLE_C = 5.0  # thermal_resume = "auto"
DEFAULT_CRITICAL_C = 80.0  # when the drive does not expose its critical threshold
CRITICAL_HYSTERESIS_C = 3.0
MIN_DEPTH = 1


class ThermalState(str, enum.Enum):
    NORMAL = "normal"
    THROTTLED = "throttled"
    CRITICAL = "critical"


@dataclass(frozen=True)
class Thresholds:
    throttle_c: float
    resume_c: float
    critical_c: float

    def describe(self) -> dict:
        return {"throttle_c": self.throttle_c, "resume_c": self.resume_c, "critical_c": self.critical_c}


def derive_thresholds(throttle_setting: float | str, resume_setting: float | str, warning_c: float | None,
                      critical_c: float | None) -> Thresholds:
    """Thresholds from the config ("auto" or °C) and what the drive says of itself.
    thermal_throttle "auto": the drive's warning threshold minus WARNING_MARGIN_C, else 65 °C."""
    critical = critical_c if critical_c else DEFAULT_CRITICAL_C
    if throttle_setting == "auto":
        throttle = warning_c - WARNING_MARGIN_C if warning_c else DEFAULT_THROTTLE_C
        throttle = min(throttle, critical - WARNING_MARGIN_C)  # a drive with odd limits must still throttle first
    else:
        throttle = float(throttle_setting)
    resume = throttle - RESUME_BELOW_THROTTLE_C if resume_setting == "auto" else float(resume_setting)
    return Thresholds(throttle_c=throttle, resume_c=min(resume, throttle), critical_c=critical)


@dataclass(frozen=True)
class Decision:
    """What the loader may do now. depth_cap None: no cap (the configured depth)."""

    state: ThermalState
    depth_cap: int | None
    prefetch_paused: bool
    loading_paused: bool


@dataclass
class ThrottlePolicy:
    thresholds: Thresholds
    full_depth: int  # io_queue_depth as configured; the first throttled step halves it
    state: ThermalState = ThermalState.NORMAL
    depth_cap: int | None = None
    entered_s: float | None = None  # when the current state began (the caller's clock)
    seconds_in: dict[str, float] = field(default_factory=lambda: {s.value: 0.0 for s in ThermalState})
    transitions: dict[str, int] = field(default_factory=dict)  # "normal->throttled" -> count

    def observe(self, temperature_c: float, now_s: float) -> tuple[Decision, str | None]:
        """The decision for this poll's temperature, and the transition ("normal->throttled")
        if the state changed (None if not)."""
        if self.entered_s is None:
            self.entered_s = now_s
        before = self.state
        t = self.thresholds
        if temperature_c >= t.critical_c:
            if self.depth_cap is None:  # straight from normal: leave critical already throttled
                self._step_down()
            self._enter(ThermalState.CRITICAL, now_s)
        elif self.state is ThermalState.CRITICAL:
            if temperature_c < t.critical_c - CRITICAL_HYSTERESIS_C:
                self._enter(ThermalState.THROTTLED, now_s)
        elif temperature_c >= t.throttle_c:
            self._step_down()
            self._enter(ThermalState.THROTTLED, now_s)
        elif self.state is ThermalState.THROTTLED and temperature_c <= t.resume_c:
            self.depth_cap = None
            self._enter(ThermalState.NORMAL, now_s)
        transition = None if self.state is before else f"{before.value}->{self.state.value}"
        if transition:
            self.transitions[transition] = self.transitions.get(transition, 0) + 1
        return self.decision(), transition

    def decision(self) -> Decision:
        cap = None if self.depth_cap is None else min(self.depth_cap, self.full_depth)
        return Decision(self.state, cap, prefetch_paused=self.state is not ThermalState.NORMAL,
                        loading_paused=self.state is ThermalState.CRITICAL)

    def time_in(self, state: ThermalState, now_s: float) -> float:
        """Seconds spent in ``state`` so far, the current stay included."""
        current = now_s - self.entered_s if self.state is state and self.entered_s is not None else 0.0
        return self.seconds_in[state.value] + current

    def _step_down(self) -> None:
        current = self.full_depth if self.depth_cap is None else self.depth_cap
        self.depth_cap = max(MIN_DEPTH, current // 2)

    def _enter(self, state: ThermalState, now_s: float) -> None:
        if state is self.state:
            return
        self.seconds_in[self.state.value] += now_s - (self.entered_s if self.entered_s is not None else now_s)
        self.state, self.entered_s = state, now_s
