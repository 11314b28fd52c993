"""status' split of resident memory over a real socket (docs/protocol.md, `memory`)."""

from __future__ import annotations

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
