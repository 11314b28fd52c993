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
    assert format_value("recent_tokens_per_s", 12.3456) == "12.3"  # one decimal is what a reader can use
    assert format_value("parameters_total", 30_500_000_000) == "30.50 B"
    assert format_value("requests_served", 12) == "12"
    assert format_value("composite_c", 48.5) == "48.5 °C"
    assert format_value("anything", None) == "-"


def test_recent_tokens_per_second_is_a_rate_row():
    table = format_status({"event": "status", "id": 3, "requests_served": 4, "recent_tokens_per_s": 41.26})

    assert table.splitlines() == ["requests served  4", "recent tokens/s  41.3"]


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


THROTTLED = {
    "state": "throttled", "reason": None, "temperature_c": 78.5, "throttle_c": 77.0, "resume_c": 72.0,
    "critical_c": 85.0, "io_queue_depth": 4, "prefetch_paused": True, "loading_paused": None, "throttled_s": 65.0,
    "critical_s": 0.0, "transitions": {"normal->throttled": 1}, "poll_s": 5.0, "polls": 40, "read_failures": 0,
    "removals": 0, "returns": 0,
    "drives": [{"controller": "nvme0", "namespace": "nvme0n1", "block_device": "nvme0n1p2",
                "model": "Fake NVMe 980 PRO 1TB", "serial": "S5GX", "firmware": "5B2QGXA7",
                "logical_block_bytes": 512, "present": True, "composite_c": 78.5, "sensors_c": {"Sensor 1": 81.0},
                "warning_c": 82.0, "critical_c": 85.0, "smart_source": "none", "smart": None}],
}


def test_a_throttled_drive_reads_as_sentences():
    assert format_status({"thermal": THROTTLED}).splitlines() == [
        "thermal                   throttled at 78.5 °C (throttle 77 °C, resume 72 °C, critical 85 °C)",
        "thermal reads in flight   4, prefetch paused",
        "thermal loading paused    -",
        "thermal time throttled    1m 05s (critical 0.0 s)",
        "thermal transitions       normal->throttled 1x",
        "thermal polls             every 5.0 s, 40 so far, 0 failed reads",
        "drive nvme0               Fake NVMe 980 PRO 1TB, serial S5GX, firmware 5B2QGXA7, on nvme0n1p2, 512-byte blocks",
        "drive nvme0 temperatures  composite 78.5 °C, Sensor 1 81 °C (warning 82 °C, critical 85 °C)",
        "drive nvme0 SMART         not read (source: none)",
    ]


def test_a_pack_not_on_nvme_is_one_line():
    thermal = {"state": "unthrottled", "reason": "no NVMe device: /p/experts.bin is on vda (virtio_blk)",
               "temperature_c": None, "throttle_c": 65.0, "io_queue_depth": 16, "throttled_s": 0.0, "drives": []}
    assert format_status({"thermal": thermal}) == \
        "thermal  unthrottled: no NVMe device: /p/experts.bin is on vda (virtio_blk)"


def test_models_without_any_model_is_just_the_header():
    assert format_models([]).split() == ["NAME", "ARCHITECTURE", "PARAMETERS", "ACTIVE",
                                         "QUANTIZATION", "PATH"]
