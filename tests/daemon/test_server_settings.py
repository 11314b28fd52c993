"""Server is configured through its constructor and reconfigure(), and asks the engine - not the
engine's expert source - for what status shows of the cache."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from colibrid.pack.damage import DamageMarks
from colibrid.daemon.connection import ClientLimits, ServerSettings
from colibrid.daemon.server import Server


class FakeEngine:
    def __init__(self) -> None:
        self.config = SimpleNamespace(architecture="olmoe")
        self.parameters_total, self.parameters_active = 7_000, 1_000
        self.pack = SimpleNamespace(manifest=SimpleNamespace(quantization={"experts": "q8_0"}, dense_size=123),
                                    notes=[], damage=DamageMarks(), path="/packs/olmoe.pack")
        self.sampling_defaults = {}
        self.cache = {"kind": "aepc", "hits": 3, "misses": 1, "bytes_read": 4096, "slots": 8, "resident_slots": 4}
        self.budget = {"available_bytes": 1 << 30, "cache_size": "50%", "cache_bytes": 1 << 29}
        self.dense = np.ones(123, dtype=np.uint8)

    def cache_status(self) -> dict:
        return dict(self.cache)

    def memory_budget(self) -> dict:
        return dict(self.budget)

    def resident_buffers(self) -> dict:
        return {"dense": self.dense, "expert_cache": None, "expert_cache_hugetlb": False}


def _engine_loop():
    return SimpleNamespace(tokens_generated=0, requests_served=0, requests_running=0, queue_depth=0, max_queue=16,
                           running_status=lambda: [], batch_status=lambda: {}, kv_status=lambda: {"used_bytes": 0},
                           prefix_cache_status=lambda: {})


def test_status_shows_what_the_constructor_and_the_engine_say():
    engine = FakeEngine()
    server = Server(engine, _engine_loop(), Path("/packs/demo.pack"), ServerSettings(max_frame_bytes=4096),
                    shown_settings={"log_level": "info"}, machine={"cpus": {"compute": "0", "io": "1"}, "nice": 5})
    status = server.status_event("s").to_wire()
    assert status["cache"] == engine.cache and status["memory_budget"] == engine.budget
    assert (status["cpus"], status["nice"], status["settings"]) == ({"compute": "0", "io": "1"}, 5, {"log_level": "info"})
    assert "thermal" not in status
    assert status["memory"]["dense_resident_bytes"] == 123 and status["memory"]["expert_cache_resident_bytes"] == 0
    engine.cache["hits"] = 10  # asked again each time: a rebuilt cache shows at once
    assert server.status_event("s").fields["cache"]["hits"] == 10
    assert "cache 4/8 experts, 91% expert hits" in server.service_status(0.0)
    assert server.hello_event(1).max_frame_bytes == 4096


def test_reconfigure_replaces_the_settings_as_a_whole():
    server = Server(FakeEngine(), _engine_loop(), Path("/packs/demo.pack"), ServerSettings(max_frame_bytes=4096),
                    shown_settings={"log_level": "info"})
    limits = ClientLimits(max_connections=3)
    server.reconfigure(ServerSettings(max_frame_bytes=8192, default_max_tokens=9, limits=limits), {"log_level": "debug"})
    assert server.hello_event(1).max_frame_bytes == 8192
    status = server.status_event("s").fields
    assert status["settings"] == {"log_level": "debug"} and status["connections"]["limit"] == 3


def test_the_recent_token_rate_is_measured_between_samples(monkeypatch):
    import colibrid.daemon.server as server_module

    now_s = [100.0]
    monkeypatch.setattr(server_module.time, "monotonic", lambda: now_s[0])
    engine_loop = _engine_loop()
    server = Server(FakeEngine(), engine_loop, Path("/packs/demo.pack"))
    engine_loop.tokens_generated, now_s[0] = 50, 102.0
    assert server.sample_token_rate() == 25.0  # 50 tokens in 2 s
    assert server.status_event("s").fields["recent_tokens_per_s"] == 25.0
