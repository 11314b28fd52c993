"""The router's health numbers (colibrictl/router_health.py) on distributions whose answers
are known, the window over routing events, and top's screen lines."""

from __future__ import annotations

import math

import pytest

from colibrictl.router_health import (
    MIN_COLLAPSE_TOKENS, RoutingWindow, default_collapse_share, entropy, imbalance,
)
from colibrictl.top import ASCII_LEVELS, UNICODE_LEVELS, Snapshot, heat_strip, render_lines
from colibrid.wire.events import RoutingEvent, RoutingLayer


def test_entropy_on_known_distributions():
    assert entropy([5] * 16, 16) == pytest.approx(1.0)  # uniform
    assert entropy([7, 0, 0, 0], 4) == pytest.approx(0.0)  # one expert
    assert entropy([9, 9, 9, 9] + [0] * 12, 16) == pytest.approx(0.5)  # top-4 always the same 4 of 16
    assert entropy([2, 1, 1, 0], 4) == pytest.approx(1.5 / 2.0)  # p = 1/2, 1/4, 1/4: 1.5 bits of 2
    assert entropy([3, 1], 2) == pytest.approx(-(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25)))
    assert entropy([0, 0], 2) is None and entropy([4], 1) is None


def test_imbalance_is_max_over_mean_load():
    assert imbalance([5] * 8, 8) == pytest.approx(1.0)
    assert imbalance([3, 1], 2) == pytest.approx(1.5)
    assert imbalance([9, 9, 9, 9] + [0] * 12, 16) == pytest.approx(4.0)  # 16 experts, top-4: the most there is
    assert imbalance([0, 0, 0], 3) is None


def test_the_collapse_share_is_halfway_from_fair_to_every_token():
    assert default_collapse_share(16, 4) == pytest.approx(0.625)
    assert default_collapse_share(64, 8) == pytest.approx(0.5625)
    assert default_collapse_share(8, 8) == pytest.approx(1.0)  # every expert every time: never collapsed


def _event(step: int, rows: int, layers: dict[int, dict[int, int]], hits=0, misses=0, dropped=0) -> RoutingEvent:
    return RoutingEvent("r", step, 1.0, rows, 1, [
        RoutingLayer(layer, sorted(counts), [counts[e] for e in sorted(counts)], hits, misses)
        for layer, counts in layers.items()], dropped)


def test_the_window_keeps_at_least_its_tokens_in_whole_steps():
    window = RoutingWindow([0], num_experts=4, top_k=1, window_tokens=10)
    for step in range(1, 6):
        window.add(_event(step, 4, {0: {step % 4: 4}}, hits=1, dropped=1))
    assert (window.tokens, window.steps, window.dropped) == (12, 3, 5)  # steps 3, 4, 5: 12 >= 10 > 8
    (layer,) = window.layers()
    assert layer.counts == [4, 4, 0, 4] and (layer.hits, layer.misses) == (3, 0)
    window.add(_event(6, 40, {0: {2: 40}}))  # one big prefill step is the whole window
    assert (window.tokens, window.steps) == (40, 1)


def test_a_layer_collapses_when_one_expert_takes_more_than_the_share():
    window = RoutingWindow([0, 1], num_experts=16, top_k=4)
    tokens = MIN_COLLAPSE_TOKENS
    spread = {e: tokens // 4 for e in range(16)}  # each expert a quarter of the tokens: fair
    piled = {0: tokens, 1: tokens // 2, 2: tokens // 2, 3: tokens // 2, **{e: tokens // 6 for e in range(4, 16)}}
    window.add(_event(1, tokens, {0: spread, 1: piled}, hits=None, misses=None))
    healthy, collapsed = window.layers()
    assert not healthy.collapsed and healthy.top_share == pytest.approx(0.25)
    assert collapsed.collapsed and (collapsed.top_expert, collapsed.top_share) == (0, 1.0)
    assert collapsed.hits is None and collapsed.misses is None  # a daemon without a cache
    (warning,) = window.warnings()
    assert warning.startswith("layer 1: routing collapsed: expert 0 chosen by 100% of the last 32 tokens")
    few = RoutingWindow([0], num_experts=16, top_k=4)
    few.add(_event(1, MIN_COLLAPSE_TOKENS - 1, {0: {0: MIN_COLLAPSE_TOKENS - 1}}))
    assert few.warnings() == []  # too few tokens to judge
    strict = RoutingWindow([1], num_experts=16, top_k=4, collapse_share=1.0)
    strict.add(_event(1, tokens, {1: piled}))
    assert strict.warnings() == []  # 100 % is not more than 100 %


def test_heat_strips_fit_their_width():
    assert heat_strip([0, 5, 10], 3, UNICODE_LEVELS) == " ▄█"
    assert heat_strip([0, 0], 2, ASCII_LEVELS) == "  "
    assert heat_strip([1] * 64, 10, ASCII_LEVELS) == "@" * 10  # 7 experts a character
    assert heat_strip([0] * 63 + [9], 8, UNICODE_LEVELS) == " " * 7 + "█"


def test_the_screen_fits_any_terminal():
    window = RoutingWindow(list(range(20)), num_experts=64, top_k=8, window_tokens=64)
    window.add(_event(1, 64, {layer: {0: 64, layer + 1: 32} for layer in range(20)}))
    status = {"model": "m", "architecture": "olmoe", "uptime_s": 5.0, "recent_tokens_per_s": 3.5, "queue_depth": 0,
              "queue_limit": 16, "requests_running": 1, "batch": {"max_batch": 8},
              "running": [{"id": 7, "phase": "decode", "tokens": 12, "tokens_per_s": 4.25, "peer": "connection 2"}],
              "cache": {"hits": 3, "misses": 1, "bytes_read": 4096, "read_busy_s": 0.5, "io_queue_depth": 16},
              "thermal": {"state": "throttled", "temperature_c": 71.0}}
    previous = ({**status, "cache": {**status["cache"], "bytes_read": 0, "read_busy_s": 0.25}}, 10.0)
    snapshot = Snapshot.take(status, previous, window, now_s=11.0)
    assert snapshot.read_bytes_per_s == 4096 and snapshot.read_busy_fraction == 0.25
    lines = render_lines(snapshot, 200)
    text = "\n".join(line for line, _ in lines)
    assert "expert reads 4.00 KiB/s" in text and "disk busy 25 %" in text and "thermal throttled at 71 °C" in text
    assert sum(line.startswith("! layer") for line, _ in lines) == 20
    for width, height in ((30, 8), (80, 24), (10, 3), (1, 1)):
        lines = render_lines(snapshot, width, height)
        assert len(lines) <= height and all(len(line) <= width for line, _ in lines)
    tall = render_lines(snapshot, 100, 200)
    assert sum(" 19  " in line for line, _ in tall) == 1  # every layer when there is room
    json_view = snapshot.as_json()
    assert json_view["io"]["hit_rate"] == 0.75 and len(json_view["layers"]) == 20
