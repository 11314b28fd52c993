"""The human units of `colibrictl status` and `models`, chosen from the field names."""

from __future__ import annotations

import pytest

from colibrictl.display import (
    format_bytes,
    format_count,
    format_duration,
    format_models,
    format_status,
    format_value,
)


@pytest.mark.parametrize("count, shown", [(0, "0 B"), (1023, "1023 B"), (1536, "1.50 KiB"),
                                          (3 * 2**30, "3.00 GiB"), (5 * 2**40, "5.00 TiB")])
def test_bytes_use_binary_units(count, shown):
    assert format_bytes(count) == shown


@pytest.mark.parametrize("count, shown", [(950, "950"), (5_260_000, "5.26 M"),
                                          (6_920_000_000, "6.92 B"), (1.2e12, "1.20 T")])
def test_parameter_counts_use_decimal_units(count, shown):
    assert format_count(count) == shown


@pytest.mark.parametrize("seconds, shown", [(5.62, "5.6 s"), (65, "1m 05s"),
                                            (3725, "1h 02m 05s"), (90061, "1d 01h 01m")])
def test_durations(seconds, shown):
    assert format_duration(seconds) == shown


def test_units_follow_the_field_name():
    assert format_value("rss_bytes", 2048) == "2.00 KiB"
    assert format_value("bytes_read", 2048) == "2.00 KiB"
    assert format_value("uptime_s", 65) == "1m 05s"
    assert format_value("decode_tokens_per_s", 41.5) == "41.5"  # a rate, not a duration
    assert format_value("parameters_total", 30_500_000_000) == "30.50 B"
    assert format_value("requests_served", 12) == "12"
    assert format_value("composite_c", 48.5) == "48.5 °C"
    assert format_value("anything", None) == "-"


def test_fields_this_client_does_not_know_are_still_shown():
    table = format_status({"event": "status", "id": 3, "model": "m",
                           "thermal": {"nvme_c": 71, "throttle_bytes": 1024},
                           "fallbacks": ["no hugepages", "no O_DIRECT"]})

    assert table.splitlines() == [
        "model             m",
        "thermal nvme      71 °C",
        "thermal throttle  1.00 KiB",
        "fallbacks         no hugepages, no O_DIRECT",
    ]


def test_models_without_any_model_is_just_the_header():
    assert format_models([]).split() == ["NAME", "ARCHITECTURE", "PARAMETERS", "ACTIVE",
                                         "QUANTIZATION", "PATH"]
