"""Human-readable rendering of the daemon's status and models replies.

Values get units chosen from the field name, the convention the protocol follows:
``*_bytes`` and ``bytes_*`` are sizes, ``*_s`` durations (``*_per_s`` are rates, left
alone), ``*_c`` degrees Celsius, ``parameters_*`` counts. Fields this client does not know yet are still shown, by
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
    if is_number and key.endswith("_s") and not key.endswith("_per_s"):  # not a rate
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
    """'memory.rss_bytes' → 'memory rss': the unit moves from the name into the value."""
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
        if isinstance(value, dict) and key not in _INLINE_MAPS:
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
