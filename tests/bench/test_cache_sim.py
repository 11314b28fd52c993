"""bench/cache_sim.py: the simulator's LRU and LFRU are the real cache's, Belady is the optimum,
and every policy keeps the cache's capacity and a step's experts together."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from tests.bench.bench_modules import load_bench_module

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "bench" / "traces" / "stdlib-greedy.jsonl"
ONLINE = ["lru", "lfru", "lfu-decay:16", "window:8", "next-use:8", "pin-half"]


sim = load_bench_module("cache_sim")


def random_steps(rng: random.Random, n: int, layers: int, experts: int, max_width: int) -> list:
    """Layer steps in layer order, as an engine's; each needs 1..max_width distinct experts."""
    steps = []
    while len(steps) < n:
        for layer in range(layers):
            width = rng.randint(1, max_width)
            steps.append((layer, tuple(sorted(rng.sample(range(experts), width)))))
    return steps[:n]


def adversarial_steps(capacity: int, layers: int) -> list:
    """Bursts that defeat recency (a scan one larger than the cache) or frequency (a hot set
    that stops being used), per layer."""
    steps = []
    for rounds in range(6):
        for layer in range(layers):
            steps += [(layer, (e,)) for e in range(capacity + 1)]  # scan
        for layer in range(layers):
            steps += [(layer, (0, 1))] * 3  # a hot pair
        if rounds % 2:
            for layer in range(layers):
                steps += [(layer, (capacity + 2 + rounds,))]  # one-off
    return steps


def hits(steps, capacity: int, spec: str, layers: int, experts: int, check: bool = True) -> int:
    policy = sim.make_policy(spec, capacity, list(range(layers)), experts)
    return sim.simulate(steps, capacity, policy, check=check).hits


def optimal_hits(steps, capacity: int) -> int:
    """Exhaustive search over every eviction choice (tiny traces only)."""
    best = {frozenset(): 0}  # resident set -> most hits so far
    for layer, experts in steps:
        keys = {(layer, e) for e in experts}
        following: dict[frozenset, int] = {}
        for resident, score in best.items():
            gained = score + len(keys & resident)
            others = sorted(resident - keys)
            overflow = len(resident | keys) - capacity
            for evicted in itertools.combinations(others, max(0, overflow)):
                state = frozenset((resident - set(evicted)) | keys)
                following[state] = max(following.get(state, -1), gained)
        best = following
    return max(best.values())


@pytest.mark.parametrize("seed", range(6))
def test_belady_is_the_optimum_on_tiny_traces(seed):
    rng = random.Random(seed)
    steps = random_steps(rng, 14, layers=2, experts=3, max_width=2)
    for capacity in (2, 3, 4):
        assert hits(steps, capacity, "belady", 2, 3) == optimal_hits(steps, capacity)


@pytest.mark.parametrize("seed", range(4))
def test_belady_never_has_fewer_hits_than_an_online_policy(seed):
    rng = random.Random(100 + seed)
    layers, experts = 3, 8
    traces = [random_steps(rng, 600, layers, experts, max_width=3)]
    for capacity in (3, 5, 8, 12):
        traces_here = traces + [adversarial_steps(capacity, layers)]
        for steps in traces_here:
            oracle = hits(steps, capacity, "belady", layers, experts)
            for spec in ONLINE[:-1]:  # pin-half counts half the trace: compared below
                assert hits(steps, capacity, spec, layers, experts) <= oracle, (spec, capacity)
            second_half = sim.simulate(steps, capacity, sim.make_policy("belady", capacity, list(range(layers)), experts),
                                       measure_from=len(steps) // 2).hits
            pinned = sim.simulate(steps, capacity, sim.make_policy("pin-half", capacity, list(range(layers)), experts),
                                  measure_from=len(steps) // 2).hits
            assert pinned <= second_half


def test_lru_gets_no_hit_on_a_cycle_longer_than_the_cache():
    for capacity in (1, 3, 7):
        cycle = [(layer, (e,)) for e in range(capacity + 1) for layer in (0, 1)]  # per layer, capacity + 1 experts
        steps = [(0, (e,)) for e in range(capacity + 1)] * 20
        assert hits(steps, capacity, "lru", 1, capacity + 1) == 0
        assert hits(cycle * 10, 2 * capacity + 1, "lru", 2, capacity + 1) == 0
        if capacity > 1:  # a trace the oracle does hit: LRU's zero is LRU's
            assert hits(steps, capacity, "belady", 1, capacity + 1) > 0


@pytest.mark.parametrize("spec", ONLINE + ["belady"])
def test_every_policy_keeps_capacity_and_pins_a_step_together(spec):
    rng = random.Random(7)
    layers, experts = 4, 16
    steps = random_steps(rng, 800, layers, experts, max_width=4)
    for capacity in (4, 6, 20):
        policy = sim.make_policy(spec, capacity, list(range(layers)), experts)
        result = sim.simulate(steps, capacity, policy, check=True)  # asserts both after every step
        assert result.hits + result.misses == sum(len(e) for _, e in steps)
    with pytest.raises(ValueError, match="needs 4 experts"):
        sim.simulate([(0, (0, 1, 2, 3))], 3, sim.make_policy(spec, 3, [0], 4))


def test_a_recorded_step_is_split_into_waves_of_the_cache_size():
    trace = sim.read_trace(TRACE)
    assert trace.moe_layers == [0, 1, 2, 3] and trace.num_experts == 16 and trace.record_bytes > 0
    steps, token_of = sim.layer_steps(trace, 3)
    assert max(len(e) for _, e in steps) == 3
    assert token_of[-1] + 1 == trace.tokens
    per_token, _ = sim.layer_steps(trace, 3, per_token=True)
    assert len(per_token) == trace.tokens * 4  # top-2 never needs a second wave at 3 slots


@pytest.mark.parametrize("policy", ["lru", "lfru", "lfu-decay", "next-use"])
def test_simulated_policies_count_what_the_real_cache_counts(demo_pack, policy):
    """The demo pack has the trained model's shape (4 layers x 16 experts): the recorded trace
    replays on it through libcolibri's cache, and the hits must be the simulator's exactly."""
    trace = sim.read_trace(TRACE)
    trace.steps = trace.steps[:300]  # prompt (many experts a step) and decode steps, and LFRU's aging
    per_token = sim.pack_requests_per_token(demo_pack)  # lfu-decay's clock, as the real cache scales it
    assert per_token == 4 * 4  # the demo pack: 4 MoE layers, top-4
    rng = random.Random(1)
    for slots in (3, 8, 16):
        for steps in (sim.layer_steps(trace, slots)[0], random_steps(rng, 400, 4, 16, max_width=min(slots, 4))):
            simulated = sim.simulate(steps, slots, sim.make_policy(policy, slots, trace.moe_layers, 16, per_token))
            real = sim.native_replay(demo_pack, steps, slots, policy)
            assert real["slots"] == slots
            assert (simulated.hits, simulated.misses) == (real["hits"], real["misses"]), (policy, slots)


def test_the_recorder_writes_every_step_of_a_greedy_generation(demo_pack, tmp_path):
    traces = load_bench_module("routing_traces")
    out = tmp_path / "trace.jsonl"
    counts = traces.record(demo_pack, out, sequences=2, prompt_tokens=8, generate=5)
    trace = sim.read_trace(out)
    assert trace.moe_layers == [0, 1, 2, 3] and trace.num_experts == 16 and trace.header["top_k"] == 4
    assert len(trace.steps) == counts["steps"] == 2 + counts["generated_tokens"]
    assert trace.tokens == counts["prompt_tokens"] + counts["generated_tokens"] == 16 + counts["generated_tokens"]
    phases = [json.loads(line)["phase"] for line in out.read_text().splitlines()[1:]]
    assert phases[0] == "prompt" and phases.count("prompt") == 2
    for step in trace.steps:
        for rows in step:  # (rows, top-k): distinct experts of the layer, in range
            assert all(len(set(row)) == 4 and all(0 <= e < 16 for e in row) for row in rows)
    assert [len(step[0]) for step in trace.steps if len(step[0]) > 1] == [8, 8]


def test_next_use_keeps_the_expert_whose_layer_comes_round_first_and_then_the_frequent_one():
    """Three layers, one expert each, each requested once at token 0: at a miss of layer 1 the
    layer-1 expert is needed last (a whole cycle away), layer 0's next, layer 2's first. A second
    request of layer 1's expert doubles its rate and moves its expected wait below layer 0's."""
    policy = sim.make_policy("next-use:8", 4, [0, 1, 2], 4)
    for key in ((0, 0), (1, 0), (2, 0)):
        policy.access(key, 0, hit=False)
        policy.touched(key, 0)
    candidates = [(0, 0), (1, 0), (2, 0)]
    assert policy.victim(candidates, 1, {}, 0) == (1, 0)
    assert policy.victim(candidates, 2, {}, 0) == (2, 0)
    policy.access((1, 0), 1, hit=True)  # a layer below the last request's: the next token
    policy.touched((1, 0), 1)
    assert policy.victim(candidates, 1, {}, 2) == (0, 0)


def test_a_trace_names_a_model_of_this_repository_by_its_path_inside_it(tmp_path):
    traces = load_bench_module("routing_traces")
    assert traces.model_name(str(traces.ROOT / "models" / "colibri-olmoe-stdlib")) == "models/colibri-olmoe-stdlib"
    assert traces.model_name(str(tmp_path / "elsewhere")) == str(tmp_path / "elsewhere")
    for shipped in (traces.ROOT / "bench" / "traces").glob("*.jsonl"):
        with shipped.open() as f:
            assert json.loads(f.readline())["model"].startswith("models/"), shipped.name
