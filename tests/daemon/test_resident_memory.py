"""status' split of resident memory over a real socket (docs/protocol.md, `memory`)."""

from __future__ import annotations

import importlib.util
import shutil
import time
from pathlib import Path

import pytest

from colibrid.daemon.residency import KEEP_S
from tests.daemon.conftest import DaemonProcess
from tests.daemon.wire import WireClient

SPLIT_KEYS = {"rss_bytes", "dense_bytes", "dense_resident_bytes", "expert_cache_resident_bytes", "expert_cache_in_rss",
              "kv_in_use_bytes", "prefix_cache_in_use_bytes", "rest_bytes"}


def _status(socket_path) -> dict:
    with WireClient(socket_path) as client:
        client.hello()
        client.send({"op": "status", "id": "s"})
        return client.recv()


def test_status_splits_resident_memory_into_its_parts(shared_daemon):
    with WireClient(shared_daemon.socket_path) as client:
        client.hello()
        client.ask(1, max_tokens=4)
        client.collect(1)
    status = _status(shared_daemon.socket_path)
    memory = status["memory"]
    assert SPLIT_KEYS <= set(memory)
    assert memory["dense_resident_bytes"] == memory["dense_bytes"]  # read whole at open
    assert 0 < memory["expert_cache_resident_bytes"] <= status["cache"]["region_bytes"]
    assert memory["kv_in_use_bytes"] == status["kv_cache"]["used_bytes"] == 0  # nothing runs
    assert memory["prefix_cache_in_use_bytes"] == status["prefix_cache"]["used_bytes"]
    parts = (memory["dense_resident_bytes"] + memory["kv_in_use_bytes"] + memory["prefix_cache_in_use_bytes"]
             + (memory["expert_cache_resident_bytes"] if memory["expert_cache_in_rss"] else 0))
    assert memory["rest_bytes"] == max(memory["rss_bytes"] - parts, 0)
    assert memory["rest_bytes"] > 0  # Python alone is tens of MiB


# What status' rest_bytes (rss less dense, expert cache, KV and prefix cache) may reach on the
# bench's shape: measured 56 MiB idle and 74-101 MiB after serving on the 16-layer OLMoE-shaped
# pack (docs/architecture.md, "Memory"); the shipped TOML's cache_size comment states it too.
REST_BOUND_BYTES = 128 << 20


@pytest.fixture(scope="module")
def bench_shaped_pack(tmp_path_factory):
    """OLMoE's shape (hidden, experts, vocabulary: the bench's) with 2 layers instead of 16."""
    bench = Path(__file__).resolve().parents[2] / "bench" / "bench_aepc.py"
    spec = importlib.util.spec_from_file_location("bench_aepc_shape", bench)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    shape = dict(module.OLMOE_SHAPE, num_layers=2)
    out = tmp_path_factory.mktemp("rest") / "olmoe2.pack"
    yield module.build_shaped_pack(out, quant="q8_0", **shape)
    shutil.rmtree(out, ignore_errors=True)


def test_the_rest_stays_under_its_documented_bound_on_the_bench_shape(bench_shaped_pack, socket_dir):
    daemon = DaemonProcess(bench_shaped_pack, socket_dir / "run" / "colibrid.sock", "--cache-size", "256M",
                           "--hugepages", "off")
    try:
        rests = [_status(daemon.socket_path)["memory"]["rest_bytes"]]
        for i in range(3):
            with WireClient(daemon.socket_path) as client:
                client.hello()
                client.ask(i, f"Request {i}: the quick brown fox jumps over the lazy dog. " * 4, max_tokens=32)
                _, done = client.collect(i)
            assert done["event"] == "done", done
            time.sleep(KEEP_S + 0.1)  # a fresh measurement
            rests.append(_status(daemon.socket_path)["memory"]["rest_bytes"])
    finally:
        returncode, stderr = daemon.terminate()
    assert returncode == 0, stderr
    assert 0 < max(rests) <= REST_BOUND_BYTES, [f"{rest / 2**20:.1f} MiB" for rest in rests]
