"""GET /metrics: what the gateway measures itself, and what colibrid's `status` says, for Prometheus.

The gateway counts requests by outcome and tokens, and times the first token and the gaps
between tokens as a client sees them (queueing and the socket included). Load balancers and
llm-d's endpoint picker route on the daemon's gauges - queue depth, running requests, KV use -
which are read from one `status` per scrape (docs/gateway.md lists every metric).
"""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# Without this every counter and histogram has a `_created` twin holding its creation time,
# which doubles the scrape and which no dashboard or endpoint picker reads (process-wide).
disable_created_metrics()

# Outcomes of a request: how its answer ended, or why there was none.
OUTCOMES = ("stop", "length", "tool_calls", "client_disconnected", "invalid_request", "unauthorized", "busy",
            "unavailable", "error")
# Seconds: a first token comes after the prompt's prefill (and any queue); gaps are milliseconds.
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
REQUEST_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
THERMAL_STATES = ("normal", "throttled", "critical", "unthrottled", "device_missing", "no_temperature", "off")


class GatewayMetrics:
    """The gateway's own counters and histograms, plus the daemon's gauges from the last status."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("colibri_requests", "HTTP generation requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=self.registry)
        self.prompt_tokens = Counter("colibri_prompt_tokens", "Prompt tokens processed", registry=self.registry)
        self.generation_tokens = Counter("colibri_generation_tokens", "Tokens generated", registry=self.registry)
        self.time_to_first_token = Histogram(
            "colibri_time_to_first_token_seconds", "From the request's arrival to its first token",
            buckets=TTFT_BUCKETS_S, registry=self.registry)
        self.inter_token_latency = Histogram(
            "colibri_inter_token_latency_seconds", "Between consecutive tokens of one answer",
            buckets=ITL_BUCKETS_S, registry=self.registry)
        self.request_duration = Histogram(
            "colibri_request_duration_seconds", "From the request's arrival to its last byte",
            buckets=REQUEST_BUCKETS_S, registry=self.registry)
        self.daemon_status = DaemonStatusCollector()
        self.registry.register(self.daemon_status)
        for endpoint in ("chat", "completions"):  # every series exists from the start, at 0
            for outcome in OUTCOMES:
                self.requests.labels(endpoint, outcome)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class DaemonStatusCollector(Collector):
    """Gauges (and the daemon's own counters) from the latest `status` event; `up` 0 without one."""

    def __init__(self) -> None:
        self.status: dict[str, Any] | None = None

    def collect(self) -> Iterator:
        status = self.status
        up = GaugeMetricFamily("colibri_daemon_up", "1 if colibrid answered status for this scrape")
        up.add_metric([], 0.0 if status is None else 1.0)
        yield up
        if status is None:
            return
        yield from self._gauges(status)
        yield from self._cache(status.get("cache"))
        yield from self._kv_cache(status.get("kv_cache"))
        yield from self._thermal(status.get("thermal"))
        yield from self._batch(status.get("batch"))

    @staticmethod
    def _gauge(name: str, documentation: str, value: Any) -> Iterator[GaugeMetricFamily]:
        number = _number(value)
        if number is not None:
            yield GaugeMetricFamily(name, documentation, value=number)

    def _gauges(self, status: dict[str, Any]) -> Iterator:
        yield from self._gauge("colibri_queue_depth", "Requests waiting in colibrid's queue", status.get("queue_depth"))
        yield from self._gauge("colibri_queue_limit", "Requests that may wait (max_queue)", status.get("queue_limit"))
        yield from self._gauge("colibri_requests_running", "Requests being generated now",
                               status.get("requests_running"))
        yield from self._gauge("colibri_recent_tokens_per_second", "Tokens generated per second, recently",
                               status.get("recent_tokens_per_s"))
        memory = status.get("memory") or {}
        yield from self._gauge("colibri_resident_memory_bytes", "colibrid's resident memory", memory.get("rss_bytes"))
        served = _number(status.get("requests_served"))
        if served is not None:
            yield CounterMetricFamily("colibri_daemon_requests_served", "Asks colibrid ended with done",
                                      value=served)

    @staticmethod
    def _cache(cache: Any) -> Iterator:
        cache = cache if isinstance(cache, dict) else {}
        for key, name, documentation in (("hits", "colibri_expert_cache_hits", "Experts found in memory"),
                                         ("misses", "colibri_expert_cache_misses", "Experts read from the pack"),
                                         ("bytes_read", "colibri_expert_cache_read_bytes",
                                          "Bytes read from the experts file")):
            value = _number(cache.get(key))
            if value is not None:
                yield CounterMetricFamily(name, documentation, value=value)

    def _kv_cache(self, kv_cache: Any) -> Iterator:
        if not isinstance(kv_cache, dict):
            return
        budget, used = _number(kv_cache.get("budget_bytes")), _number(kv_cache.get("used_bytes"))
        yield from self._gauge("colibri_kv_cache_budget_bytes", "Memory set aside for sequences' KV", budget)
        yield from self._gauge("colibri_kv_cache_used_bytes", "KV memory in use", used)
        if budget and used is not None:
            yield from self._gauge("colibri_kv_cache_usage_ratio", "KV memory in use, 0 to 1 (for endpoint pickers)",
                                   used / budget)

    def _thermal(self, thermal: Any) -> Iterator:
        if not isinstance(thermal, dict):
            return
        state = thermal.get("state")
        if isinstance(state, str):
            family = GaugeMetricFamily("colibri_thermal_state", "1 for the thermal watch's current state",
                                       labels=["state"])
            for name in sorted({*THERMAL_STATES, state}):
                family.add_metric([name], 1.0 if name == state else 0.0)
            yield family
        yield from self._gauge("colibri_drive_temperature_celsius", "The hottest NVMe drive under the pack",
                               thermal.get("temperature_c"))

    @staticmethod
    def _batch(batch: Any) -> Iterator:
        """Whatever numbers colibrid reports about its batch, one gauge each."""
        if not isinstance(batch, dict):
            return
        for key, value in sorted(batch.items()):
            number = _number(value)
            if number is not None and isinstance(key, str) and key.replace("_", "").isalnum():
                yield GaugeMetricFamily(f"colibri_batch_{key}", f"colibrid's status batch.{key}", value=number)
