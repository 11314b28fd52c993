"""Human-readable rendering of the daemon's status and models replies.

Values get units chosen from the field name, the convention the protocol follows:
``*_bytes`` and ``bytes_*`` are sizes, ``*_s`` durations, ``*_per_s`` rates (one decimal,
``/s`` in the label), ``*_c`` degrees Celsius, ``parameters_*`` counts. Fields this client does not know yet are still shown, by
the same rules, so a newer daemon is never hidden behind an older client.
"""

from __future__ import annotations

from typing import Any, Iterable

# Keys of the status event that describe the envelope, not the daemon.
_ENVELOPE_KEYS = ("event", "id")


def format_bytes(count: int | float) -> str:
    """1536 → '1.50 KiB': binary units, because memory and pages are powers of two."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_count(count: int | float) -> str:
    """6_920_000_000 → '6.92 B' (billions), the way model sizes are spoken of."""
    value = float(count)
    for threshold, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= threshold:
            return f"{value / threshold:.2f} {suffix}"
    return f"{int(value)}"


def format_duration(seconds: int | float) -> str:
    """3725 → '1h 02m 05s'; under a minute keeps one decimal."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = int(seconds)
    days, whole = divmod(whole, 86400)
    hours, whole = divmod(whole, 3600)
    minutes, secs = divmod(whole, 60)
    if days:
        return f"{days}d {hours:02d}h {minutes:02d}m"
    if hours:
        return f"{hours}h {minutes:02d}m {secs:02d}s"
    return f"{minutes}m {secs:02d}s"


def format_value(key: str, value: Any) -> str:
    """One field's value with the unit its name implies."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if is_number and (key.endswith("_bytes") or key.startswith("bytes_")):  # bytes_read too
        return format_bytes(value)
    if is_number and key.endswith("_per_s"):  # a rate: 41.52 tokens/s reads as 41.5
        return f"{value:.1f}"
    if is_number and key.endswith("_s"):
        return format_duration(value)
    if is_number and key.endswith("_c"):  # temperatures, e.g. of the NVMe drive
        return f"{value:g} °C"
    if is_number and key.startswith("parameters_"):
        return format_count(value)
    if isinstance(value, dict):  # a small map (e.g. quantization) on one line
        return ", ".join(f"{k}={format_value(str(k), v)}" for k, v in value.items()) or "-"
    if isinstance(value, (list, tuple)):
        return ", ".join(format_value(key, v) for v in value) or "-"
    if value is None:
        return "-"
    return str(value)


def _label(key: str) -> str:
    """'memory.rss_bytes' → 'memory rss': the unit moves from the name into the value (a
    rate keeps it in the label: 'recent_tokens_per_s' → 'recent tokens/s')."""
    if key.endswith("_per_s"):
        return _label(key[: -len("_per_s")]) + "/s"
    for suffix in ("_bytes", "_s", "_c"):
        if key.endswith(suffix) and not key.endswith("_per_s"):
            key = key[: -len(suffix)]
    return key.replace(".", " ").replace("_", " ")


def aligned_rows(rows: Iterable[tuple[str, str]]) -> str:
    """Two columns, labels padded so every value starts at the same column."""
    rows = list(rows)
    width = max((len(label) for label, _ in rows), default=0)
    return "\n".join(f"{label.ljust(width)}  {value}" for label, value in rows)


# Maps shown as one row of k=v pairs rather than a row per key: they are descriptions, not
# measurements.
_INLINE_MAPS = frozenset({"quantization"})


def status_rows(status: dict) -> list[tuple[str, str]]:
    """The status event as (label, value) rows; nested maps become 'parent child' rows."""
    rows: list[tuple[str, str]] = []
    for key, value in status.items():
        if key in _ENVELOPE_KEYS:
            continue
        if key == "thermal" and isinstance(value, dict):
            rows.extend(thermal_rows(value))
        elif isinstance(value, dict) and key not in _INLINE_MAPS:
            for child_key, child_value in value.items():
                rows.append((_label(f"{key}.{child_key}"), format_value(child_key, child_value)))
            if key == "cache":
                rows.extend(_cache_hit_rate_row(value))
        else:
            rows.append((_label(key), format_value(key, value)))
    return rows


def _cache_hit_rate_row(cache: dict) -> list[tuple[str, str]]:
    """The number people actually want from hits and misses."""
    hits, misses = cache.get("hits"), cache.get("misses")
    if not isinstance(hits, int) or not isinstance(misses, int) or hits + misses == 0:
        return []
    return [("cache hit rate", f"{100.0 * hits / (hits + misses):.1f} %")]


def _celsius(value: Any) -> str:
    return format_value("_c", value)


# The thermal map's fields that thermal_rows() words itself; any other is shown by the usual rules.
_THERMAL_KEYS = frozenset({"state", "reason", "temperature_c", "throttle_c", "resume_c", "critical_c",
                           "io_queue_depth", "prefetch_paused", "loading_paused", "throttled_s", "critical_s",
                           "transitions", "drives", "poll_s", "polls", "read_failures", "removals", "returns"})


def thermal_rows(thermal: dict) -> list[tuple[str, str]]:
    """The thermal watch in sentences: state and temperature against the thresholds, what the
    loader may do, time throttled, then one block per drive (identity, temperatures, SMART)."""
    rows: list[tuple[str, str]] = []
    state = thermal.get("state")
    if state is not None:
        line = str(state)
        if thermal.get("temperature_c") is not None:
            line += f" at {_celsius(thermal['temperature_c'])}"
        if thermal.get("reason"):
            line += f": {thermal['reason']}"
        elif "throttle_c" in thermal and state not in ("off", "unthrottled"):
            line += (f" (throttle {_celsius(thermal['throttle_c'])}, resume {_celsius(thermal.get('resume_c'))}, "
                     f"critical {_celsius(thermal.get('critical_c'))})")
        rows.append(("thermal", line))
    if "io_queue_depth" in thermal and state not in ("off", "unthrottled", None):
        reads = f"{thermal['io_queue_depth']}" + (", prefetch paused" if thermal.get("prefetch_paused") else "")
        rows.append(("thermal reads in flight", reads))
        rows.append(("thermal loading paused", format_value("loading_paused", thermal.get("loading_paused"))))
    if "throttled_s" in thermal and state not in ("off", "unthrottled", None):
        rows.append(("thermal time throttled", f"{format_duration(thermal['throttled_s'])} "
                                               f"(critical {format_duration(thermal.get('critical_s', 0))})"))
        transitions = thermal.get("transitions") or {}
        rows.append(("thermal transitions", ", ".join(f"{k} {v}x" for k, v in transitions.items()) or "none"))
        rows.append(("thermal polls", f"every {format_duration(thermal.get('poll_s', 0))}, {thermal.get('polls', 0)} so far, "
                                      f"{thermal.get('read_failures', 0)} failed reads"))
        if thermal.get("removals"):
            rows.append(("thermal removals", f"{thermal['removals']} removed, {thermal.get('returns', 0)} back"))
    for key, value in thermal.items():
        if key not in _THERMAL_KEYS:
            rows.append((_label(f"thermal.{key}"), format_value(key, value)))
    for drive in thermal.get("drives") or []:
        rows.extend(_drive_rows(drive))
    return rows


def _drive_rows(drive: dict) -> list[tuple[str, str]]:
    name = f"drive {drive.get('controller', '?')}"
    identity = (f"{drive.get('model', '?')}, serial {drive.get('serial', '?')}, firmware {drive.get('firmware', '?')}, "
                f"on {drive.get('block_device', '?')}, {drive.get('logical_block_bytes', '?')}-byte blocks")
    if drive.get("present") is False:
        identity = "REMOVED — " + identity
    rows = [(name, identity)]
    temperatures = [f"composite {_celsius(drive.get('composite_c'))}"]
    temperatures += [f"{label} {_celsius(t)}" for label, t in (drive.get("sensors_c") or {}).items()]
    limits = [f"{word} {_celsius(drive[key])}" for word, key in (("warning", "warning_c"), ("critical", "critical_c"))
              if drive.get(key) is not None]
    rows.append((f"{name} temperatures", ", ".join(temperatures) + (f" ({', '.join(limits)})" if limits else "")))
    smart = drive.get("smart")
    source = drive.get("smart_source", "none")
    if smart:
        warnings = ", ".join(smart.get("critical_warnings") or []) or "none"
        rows.append((f"{name} SMART", f"via {source}: spare {smart.get('available_spare_pct')} % (threshold "
                                      f"{smart.get('available_spare_threshold_pct')} %), {smart.get('percentage_used')} % used, "
                                      f"{smart.get('media_errors')} media errors, critical warnings: {warnings}"))
    else:
        rows.append((f"{name} SMART", f"not read (source: {source})"))
    return rows


def format_status(status: dict) -> str:
    return aligned_rows(status_rows(status))


_MODEL_COLUMNS = (
    ("NAME", "name"),
    ("ARCHITECTURE", "architecture"),
    ("PARAMETERS", "parameters_total"),
    ("ACTIVE", "parameters_active"),
    ("QUANTIZATION", "quantization"),
    ("PATH", "path"),
)


def format_models(models: list[dict]) -> str:
    """One row per model under a header, columns padded to their widest cell."""
    table = [[header for header, _ in _MODEL_COLUMNS]]
    for model in models:
        table.append([format_value(key, model.get(key)) for _, key in _MODEL_COLUMNS])
    widths = [max(len(row[column]) for row in table) for column in range(len(_MODEL_COLUMNS))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
             for row in table]
    return "\n".join(lines)
