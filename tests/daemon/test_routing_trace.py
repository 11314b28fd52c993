"""bench_aepc records a daemon's routing stream as a trace and replays a trace (its own, or
`colibrictl ask --json --debug-routing` output) through the expert cache."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from tests.daemon.wire import WireClient

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_aepc", ROOT / "bench" / "bench_aepc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_recorded_trace_replays_through_the_cache(shared_daemon, demo_pack, tmp_path):
    bench = _bench()
    trace = tmp_path / "trace.jsonl"
    recorded = {}
    recorder = threading.Thread(target=lambda: recorded.update(
        steps=bench.record_trace(str(shared_daemon.socket_path), trace, seconds=30, steps=5)))
    recorder.start()
    with WireClient(shared_daemon.socket_path) as client:
        client.hello()
        n = 0
        while recorder.is_alive() and n < 50:  # until the recorder has its five steps
            client.ask(n, max_tokens=3, ignore_eos=True)
            client.collect(n)
            n += 1
    recorder.join(30)
    assert recorded["steps"] == 5
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert lines[0]["event"] == "subscribed" and [line["event"] for line in lines[1:]] == ["routing"] * 5
    steps = bench.read_trace(trace)
    assert len(steps) == 5 and all([layer for layer, _ in step] == [0, 1, 2, 3] for step in steps)

    needed = sum(len(experts) for step in steps for _, experts in step)
    whole = bench.replay_trace(demo_pack, steps, cache_bytes=1 << 30, policy="lru")  # every expert fits
    distinct = len({(layer, e) for step in steps for layer, experts in step for e in experts})
    assert (whole["hits"] + whole["misses"], whole["misses"]) == (needed, distinct)  # each read once, then hits
    assert whole["bytes_read"] > 0
    small = bench.replay_trace(demo_pack, steps, cache_bytes=3 * 110_592, policy="lru")  # 3 slots of the demo's 108 KiB records
    assert small["hits"] + small["misses"] == needed and small["misses"] >= distinct


def test_debug_routing_output_is_a_trace_too(shared_daemon, demo_pack, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "colibrictl", "--socket", str(shared_daemon.socket_path), "ask",
                          "--json", "--debug-routing", "--max-tokens", "4", "--temperature", "0", "def f(x):"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 0, run.stderr
    tokens = [json.loads(line) for line in run.stdout.splitlines() if json.loads(line)["event"] == "token"]
    assert tokens and all(len(token["routing"]["experts"]) == 4 for token in tokens)
    trace = tmp_path / "ask.jsonl"
    trace.write_text(run.stdout)
    steps = _bench().read_trace(trace)
    assert steps == [[(layer, sorted(experts)) for layer, experts in zip(token["routing"]["layers"],
                                                                          token["routing"]["experts"])]
                     for token in tokens]
    refused = subprocess.run([sys.executable, "-m", "colibrictl", "--socket", str(shared_daemon.socket_path), "ask",
                              "--debug-routing", "hi"], capture_output=True, text=True, env=env, timeout=60)
    assert refused.returncode == 2 and "--json" in refused.stderr
