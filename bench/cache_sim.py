"""Trace-driven expert cache simulator: how close an eviction policy comes to the oracle.

    python bench/cache_sim.py bench/traces/stdlib-greedy.jsonl
    python bench/cache_sim.py bench/traces/stdlib-greedy.jsonl --fractions 0.05,0.125,0.25,0.5 \
        --validate ~/.cache/colibri/colibri-olmoe-stdlib.pack

A trace (bench/routing_traces.py, or bench_aepc.py trace-record / `colibrictl ask --json
--debug-routing` output) becomes a list of layer steps: (layer, the distinct experts the step
needs). A step pins its experts together, as the real cache's acquire does, so a step never
evicts what it needs itself; a step needing more experts than the cache has slots is split into
waves of at most that many (as the engine and bench_aepc trace-replay do). Capacity is in slots,
one expert record each (uniform record sizes, as in every pack).

Policies:
  lru        the C cache's LRU, exactly (tick per requested expert, hits pinned first)
  lfru       the C cache's LFRU, exactly: per-layer quotas of slots // layers, LFU within
             (request counts halved every 8 x slots requests), least recent on ties
  belady     the oracle: evict the resident expert whose next use is farthest in the future
             (never used again first; ties: the lowest (layer, expert)) - the upper bound
  lfu-decay  online: frequency with exponential decay (half-life in decode tokens,
             `lfu-decay:16`, the default), least recent on ties: the C cache's lfu-decay, exactly
             (its clock counts requested experts; a token is the trace's MoE layers x top-k of them)
  window     online, least-stale: evict the expert used least often in the last W tokens
             (`window:32`), least recent on ties - what the recent window did not use goes first
  next-use   online: evict the expert whose next request is expected farthest ahead in layer
             steps (its layer's turn in the cycle, plus L per token it is expected to wait at
             its decayed per-token rate; `next-use:16` half-life in tokens, the default): the C cache's
             next-use, exactly (a token is a pass over the layers, as the cache counts it)
  pin-half   online with hindsight from the past: the experts most used in the trace's first
             half stay pinned (half the slots, capped per layer by the layer's share), LRU on the
             rest; only meaningful on the second half, so its row reports that half only

`--validate PACK` replays the same layer steps through the real expert cache (libcolibri, via
bench_aepc.replay_trace) at the same slot counts and prints the LRU, LFRU and lfu-decay hit
and next-use rates side by side: the simulator must match within one point (it is exact by construction; the
check keeps it so).

Shape letters: S layer steps, L MoE layers, E experts per layer, C slots.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

Key = tuple[int, int]  # (layer, expert)
LayerStep = tuple[int, tuple[int, ...]]  # (layer, distinct experts), pinned together

DEFAULT_FRACTIONS = "0.05,0.125,0.25,0.5"
DEFAULT_POLICIES = "lru,lfru,lfu-decay,window,pin-half,belady"
NEVER = math.inf


# --------------------------------------------------------------------------------------------
# Traces
# --------------------------------------------------------------------------------------------


@dataclass
class Trace:
    """Routing of a run: per engine step, per MoE layer, the experts of each row (token)."""

    moe_layers: list[int]
    num_experts: int
    record_bytes: int | None  # one expert record; None when the trace does not say
    steps: list[list[list[list[int]]]]  # per step: (L, rows, A) experts as nested lists
    header: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(len(step[0]) for step in self.steps if step)


def read_trace(path: Path) -> Trace:
    """A routing_traces.py trace (header line, then one line per engine step), or a bench_aepc
    trace-record / `ask --json --debug-routing` output (one row per step, the experts a layer
    needed; the model's shape is read from the `subscribed` event or guessed from the trace)."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    if not lines:
        raise SystemExit(f"{path} is empty")
    first = json.loads(lines[0])
    if first.get("trace") == "colibri-routing":
        steps = [json.loads(line)["experts"] for line in lines[1:]]
        return Trace(list(first["moe_layers"]), int(first["num_experts"]), first.get("record_bytes"), steps, first)
    from bench_aepc import read_trace as read_aepc_trace

    aepc_steps = read_aepc_trace(path)
    if not aepc_steps:
        raise SystemExit(f"{path} holds no routing steps")
    layers = sorted({layer for step in aepc_steps for layer, _ in step})
    num_experts = first.get("num_experts") or 1 + max(e for step in aepc_steps for _, ex in step for e in ex)
    # Each summary's experts are the step's union: one row per step, whatever it held.
    steps = [[[list(dict(step).get(layer, []))] for layer in layers] for step in aepc_steps]
    return Trace(layers, int(num_experts), None, steps, first)


def layer_steps(trace: Trace, capacity: int, per_token: bool = False) -> tuple[list[LayerStep], list[int]]:
    """The trace's layer steps in order, each split into waves of at most ``capacity`` experts,
    and, per layer step, the index of the token it belongs to (a step's rows count once each:
    the token index of a step is that of its last row).

    per_token: every row is its own step (as if the engine ran one token at a time)."""
    out: list[LayerStep] = []
    token_of: list[int] = []
    token = 0
    for step in trace.steps:
        rows = len(step[0]) if step else 0
        groups = [[r] for r in range(rows)] if per_token else [list(range(rows))]
        for group in groups:
            token += len(group)
            for layer, per_row in zip(trace.moe_layers, step):
                needed = sorted({int(e) for r in group for e in per_row[r]})
                for first in range(0, len(needed), capacity):
                    out.append((layer, tuple(needed[first:first + capacity])))
                    token_of.append(token - 1)
    return out, token_of


# --------------------------------------------------------------------------------------------
# Policies. The simulation loop (simulate) does what col_expert_cache_acquire does; a policy
# only hears about accesses and chooses victims among the unpinned residents.
# --------------------------------------------------------------------------------------------


class Policy:
    name = "?"

    def __init__(self, capacity: int, layers: list[int], num_experts: int) -> None:
        self.capacity = capacity
        self.layers = layers
        self.num_experts = num_experts
        self.tick = 0  # one per requested expert, as the C cache's
        self.last_used: dict[Key, int] = {}

    def begin(self, steps: list[LayerStep], token_of: list[int]) -> None:
        """The whole run ahead (only the oracle and the learned pins look)."""

    def access(self, key: Key, index: int, hit: bool) -> None:
        """``key`` was requested by layer step ``index`` (before a victim is chosen for it)."""

    def touched(self, key: Key, index: int) -> None:
        """``key`` is resident and was used by step ``index`` (after access, and after its load)."""
        self.tick += 1
        self.last_used[key] = self.tick

    def evicted(self, key: Key) -> None:
        self.last_used.pop(key, None)

    def victim(self, candidates: list[Key], layer: int, resident_per_layer: dict[int, int], index: int) -> Key:
        raise NotImplementedError


class LRU(Policy):
    name = "lru"

    def victim(self, candidates, layer, resident_per_layer, index):
        return min(candidates, key=lambda k: self.last_used[k])


class LFRU(Policy):
    """col_expert_cache's LFRU: a layer at its quota gives up one of its own; a layer under it
    takes from a layer over quota, else from anyone; least frequently requested, then least
    recent, within. Request counts of every key are halved every 8 x slots requests."""

    name = "lfru"

    def __init__(self, capacity, layers, num_experts):
        super().__init__(capacity, layers, num_experts)
        self.freq: dict[Key, int] = defaultdict(int)
        self.since_aging = 0
        self.quota = max(1, capacity // max(1, len(layers)))

    def access(self, key, index, hit):
        self.freq[key] += 1
        self.since_aging += 1
        if self.since_aging >= 8 * self.capacity:
            for k in self.freq:
                self.freq[k] >>= 1
            self.since_aging = 0

    def _lfu(self, candidates):
        return min(candidates, key=lambda k: (self.freq[k], self.last_used[k]), default=None)

    def victim(self, candidates, layer, resident_per_layer, index):
        v = None
        if resident_per_layer[layer] >= self.quota:
            v = self._lfu([k for k in candidates if k[0] == layer])
        if v is None:
            v = self._lfu([k for k in candidates if resident_per_layer[k[0]] > self.quota])
        return v if v is not None else self._lfu(candidates)


class Belady(Policy):
    """Evicts the candidate whose next request is farthest ahead (never: first). The step being
    served pins its own experts, so no candidate is needed before the next step."""

    name = "belady"

    def begin(self, steps, token_of):
        upcoming: dict[Key, list[int]] = defaultdict(list)  # key -> step indices, latest first
        for index in range(len(steps) - 1, -1, -1):
            layer, experts = steps[index]
            for e in experts:
                upcoming[(layer, e)].append(index)
        self.upcoming = upcoming

    def access(self, key, index, hit):
        uses = self.upcoming[key]
        while uses and uses[-1] <= index:
            uses.pop()

    def next_use(self, key: Key) -> float:
        uses = self.upcoming.get(key)
        return uses[-1] if uses else NEVER

    def victim(self, candidates, layer, resident_per_layer, index):
        return max(candidates, key=lambda k: (self.next_use(k), -k[0], -k[1]))


class DecayedLFU(Policy):
    """col_expert_cache's lfu-decay: each request adds 1 to a key's score, and scores halve every
    ``half_life_tokens`` x ``requests_per_token`` requests (the cache's clock counts requested
    experts); the lowest score goes, the least recent on ties. The same double arithmetic as
    count_decayed in expert_cache.c, so the counters are the real cache's exactly."""

    name = "lfu-decay"

    def __init__(self, capacity, layers, num_experts, half_life_tokens: float = 16.0, requests_per_token: int = 1):
        super().__init__(capacity, layers, num_experts)
        self.half_life = float(max(1, int(half_life_tokens * requests_per_token)))  # in requests, as C's int
        self.requests = 0
        self.score: dict[Key, float] = {}
        self.stamp: dict[Key, int] = {}
        self.rank: dict[Key, float] = {}  # log2(score) + stamp / h: orders scores decayed to any common time
        self.name = f"lfu-decay:{half_life_tokens:g}"

    def access(self, key, index, hit):
        self.requests += 1
        now, h = self.requests, self.half_life
        score = self.score.get(key, 0.0) * math.exp2(-float(now - self.stamp.get(key, 0)) / h) + 1.0
        self.score[key], self.stamp[key] = score, now
        self.rank[key] = math.log2(score) + float(now) / h

    def victim(self, candidates, layer, resident_per_layer, index):
        return min(candidates, key=lambda k: (self.rank.get(k, -NEVER), self.last_used[k]))


class WindowLFU(Policy):
    """Least-stale: the candidate requested least often in the last ``window`` tokens goes first
    (one not requested in the window at all before any that was), the least recent on ties."""

    name = "window"

    def __init__(self, capacity, layers, num_experts, window_tokens: int = 32):
        super().__init__(capacity, layers, num_experts)
        self.window = window_tokens
        self.recent: deque[tuple[int, Key]] = deque()  # (token, key) of every request in the window
        self.count: dict[Key, int] = defaultdict(int)
        self.name = f"window:{window_tokens}"

    def begin(self, steps, token_of):
        self.token_of = token_of

    def access(self, key, index, hit):
        now = self.token_of[index]
        while self.recent and self.recent[0][0] <= now - self.window:
            self.count[self.recent.popleft()[1]] -= 1
        self.recent.append((now, key))
        self.count[key] += 1

    def victim(self, candidates, layer, resident_per_layer, index):
        return min(candidates, key=lambda k: (self.count[k], self.last_used[k]))


class ExpectedNextUse(Policy):
    """col_expert_cache's next-use: evicts the candidate whose next request is expected farthest
    ahead, in layer steps - the steps until its layer comes round again, plus L for each further
    token it is expected to wait, (1 - p) / p of them for a per-token rate p: the tokens that
    requested it, decayed with half-life ``half_life_tokens``. A token is a pass over the layers,
    as the cache counts it: the clock ticks when a request's layer is below the previous one's
    (a prompt step is one pass). Least recent on ties. The same double arithmetic as
    expected_steps in expert_cache.c, so the counters are the real cache's exactly."""

    name = "next-use"

    def __init__(self, capacity, layers, num_experts, half_life_tokens: float = 16.0):
        super().__init__(capacity, layers, num_experts)
        self.decay = 2.0 ** (-1.0 / int(half_life_tokens))  # C's half-life is an int
        self.position = {layer: i for i, layer in enumerate(sorted(layers))}
        self.cycle, self.last_layer = 0, -1
        self.rate: dict[Key, float] = {}
        self.rate_cycle: dict[Key, int] = {}
        self.name = f"next-use:{half_life_tokens:g}"

    def access(self, key, index, hit):
        if key[0] < self.last_layer:
            self.cycle += 1
        self.last_layer = key[0]
        last = self.rate_cycle.get(key)
        if last != self.cycle:
            kept = 0.0 if last is None else self.rate[key] * self.decay ** float(self.cycle - last)
            self.rate[key], self.rate_cycle[key] = kept + 1.0, self.cycle

    def _expected_steps(self, key: Key, layer: int) -> float:
        layers = len(self.layers)
        until = (self.position[key[0]] - self.position[layer]) % layers or layers
        last = self.rate_cycle.get(key)
        rate = 0.0 if last is None else self.rate[key] * self.decay ** float(self.cycle - last) * (1.0 - self.decay)
        rate = min(max(rate, 1e-9), 1.0)
        return until + layers * (1.0 - rate) / rate

    def victim(self, candidates, layer, resident_per_layer, index):
        return max(candidates, key=lambda k: (self._expected_steps(k, layer), -self.last_used[k]))


class PinFirstHalf(LRU):
    """The experts most requested in the first half of the run never leave once loaded (up to
    half the slots, each layer at most its share of them); LRU among the others."""

    name = "pin-half"

    def begin(self, steps, token_of):
        half = len(steps) // 2
        counts: dict[Key, int] = defaultdict(int)
        for layer, experts in steps[:half]:
            for e in experts:
                counts[(layer, e)] += 1
        budget = self.capacity // 2
        per_layer_cap = max(1, budget // max(1, len(self.layers)))
        taken: dict[int, int] = defaultdict(int)
        self.pinned: set[Key] = set()
        for key in sorted(counts, key=lambda k: (-counts[k], k)):
            if len(self.pinned) >= budget:
                break
            if taken[key[0]] < per_layer_cap:
                self.pinned.add(key)
                taken[key[0]] += 1

    def victim(self, candidates, layer, resident_per_layer, index):
        free = [k for k in candidates if k not in self.pinned]
        return super().victim(free or candidates, layer, resident_per_layer, index)


def make_policy(spec: str, capacity: int, layers: list[int], num_experts: int, requests_per_token: int = 1) -> Policy:
    """``name`` or ``name:parameter`` (lfu-decay:half-life tokens, window:tokens).
    ``requests_per_token``: experts a decode token requests (MoE layers x top-k), lfu-decay's clock."""
    name, _, arg = spec.partition(":")
    if name == "lru":
        return LRU(capacity, layers, num_experts)
    if name == "lfru":
        return LFRU(capacity, layers, num_experts)
    if name == "belady":
        return Belady(capacity, layers, num_experts)
    if name == "lfu-decay":
        return DecayedLFU(capacity, layers, num_experts, float(arg or 16), requests_per_token)
    if name == "window":
        return WindowLFU(capacity, layers, num_experts, int(arg or 32))
    if name == "next-use":
        return ExpectedNextUse(capacity, layers, num_experts, float(arg or 16))
    if name == "pin-half":
        return PinFirstHalf(capacity, layers, num_experts)
    raise SystemExit(f"unknown policy {spec!r} (lru, lfru, belady, lfu-decay[:half-life], window[:tokens], "
                     "next-use[:half-life], pin-half)")


# --------------------------------------------------------------------------------------------
# The simulation: col_expert_cache_acquire's order of events, one layer step at a time
# --------------------------------------------------------------------------------------------


@dataclass
class Result:
    policy: str
    slots: int
    hits: int
    misses: int
    tokens: int  # tokens of the measured part

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    @property
    def records_per_token(self) -> float:
        return self.misses / self.tokens if self.tokens else 0.0


def simulate(steps: list[LayerStep], capacity: int, policy: Policy, token_of: list[int] | None = None,
             measure_from: int = 0, check: bool = False) -> Result:
    """Runs ``steps`` through a cache of ``capacity`` slots under ``policy``; counts hits and
    misses of the steps from ``measure_from`` on. ``check``: assert the invariants (capacity,
    the step's experts resident together) after every step - for the tests."""
    token_of = token_of if token_of is not None else list(range(len(steps)))
    policy.begin(steps, token_of)
    resident: set[Key] = set()
    per_layer: dict[int, int] = defaultdict(int)
    hits = misses = 0
    for index, (layer, experts) in enumerate(steps):
        if len(experts) > capacity:
            raise ValueError(f"step {index} needs {len(experts)} experts, the cache has {capacity} slots")
        keys = [(layer, e) for e in experts]
        pinned = {k for k in keys if k in resident}  # hits are pinned first, as acquire does
        counted = index >= measure_from
        for key in keys:
            hit = key in resident
            policy.access(key, index, hit)
            if not hit:
                if len(resident) >= capacity:
                    victim = policy.victim([k for k in resident if k not in pinned], layer, per_layer, index)
                    resident.discard(victim)
                    per_layer[victim[0]] -= 1
                    policy.evicted(victim)
                resident.add(key)
                per_layer[layer] += 1
                pinned.add(key)
            hits += hit and counted
            misses += (not hit) and counted
            policy.touched(key, index)
        if check:
            assert len(resident) <= capacity, (index, len(resident), capacity)
            assert all(k in resident for k in keys), (index, keys)
    first_token = token_of[measure_from] if measure_from < len(token_of) else 0
    tokens = (token_of[-1] + 1 - first_token) if token_of else 0
    return Result(policy.name, capacity, hits, misses, tokens)


def slots_for(fraction: float, n_records: int) -> int:
    return max(1, min(n_records, int(n_records * fraction)))


def trace_requests_per_token(trace: Trace) -> int:
    """Experts one decode token requests: MoE layers x top-k (the header's, else the widest row)."""
    top_k = trace.header.get("top_k") or max((len(row) for step in trace.steps for rows in step for row in rows), default=1)
    return len(trace.moe_layers) * int(top_k)


def pack_requests_per_token(pack_path: Path) -> int:
    """The same for a pack: what the real cache's lfu-decay clock is scaled by."""
    from colibrid.pack.reader import Pack

    manifest = Pack.open(pack_path).manifest
    return len({r.layer for r in manifest.expert_records}) * max(1, manifest.model.num_experts_per_tok)


def run_policy(trace: Trace, spec: str, slots: int, per_token: bool = False, second_half: bool = False) -> Result:
    """One policy on the trace; pin-half (which learns from the first half) and ``second_half``
    count the second half of the layer steps only."""
    steps, token_of = layer_steps(trace, slots, per_token)
    policy = make_policy(spec, slots, trace.moe_layers, trace.num_experts, trace_requests_per_token(trace))
    measure_from = len(steps) // 2 if second_half or spec.startswith("pin-half") else 0
    return simulate(steps, slots, policy, token_of, measure_from)


# --------------------------------------------------------------------------------------------
# Against the real cache
# --------------------------------------------------------------------------------------------


def native_replay(pack_path: Path, steps: list[LayerStep], slots: int, policy: str) -> dict:
    """The real cache's counters on the same layer steps (each one acquire: none exceeds the slots)."""
    from bench_aepc import replay_trace
    from colibrid.engine.experts.slab import expert_slot_bytes
    from colibrid.pack.reader import Pack

    slot_bytes = expert_slot_bytes(Pack.open(pack_path).manifest)
    return replay_trace(pack_path, [[(layer, list(experts))] for layer, experts in steps], slots * slot_bytes, policy)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def format_bytes_per_token(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("trace", type=Path, help="routing trace (bench/routing_traces.py or bench_aepc.py trace-record)")
    parser.add_argument("--fractions", default=DEFAULT_FRACTIONS,
                        help=f"cache sizes as fractions of all expert records (default {DEFAULT_FRACTIONS})")
    parser.add_argument("--policies", default=DEFAULT_POLICIES, help=f"default {DEFAULT_POLICIES}")
    parser.add_argument("--record-bytes", type=int, default=None,
                        help="bytes of one expert record (default: the trace's header, else --pack's manifest)")
    parser.add_argument("--pack", type=Path, default=None, help="the model's pack, for the record size")
    parser.add_argument("--per-token", action="store_true",
                        help="one layer step per token (prompt tokens too), instead of per engine step as recorded")
    parser.add_argument("--validate", type=Path, default=None, metavar="PACK",
                        help="also replay LRU, LFRU, lfu-decay and next-use through the real cache on this pack (same shape as the trace)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)

    trace = read_trace(args.trace)
    record_bytes = args.record_bytes or trace.record_bytes
    pack_path = args.pack or args.validate
    if record_bytes is None and pack_path is not None:
        from colibrid.pack.reader import Pack

        record_bytes = max(r.length for r in Pack.open(pack_path).manifest.expert_records)
    n_records = len(trace.moe_layers) * trace.num_experts
    print(f"{args.trace}: {len(trace.steps)} engine steps, {trace.tokens} tokens; {len(trace.moe_layers)} MoE layers x "
          f"{trace.num_experts} experts = {n_records} records"
          + (f" of {record_bytes} bytes" if record_bytes else " (record size unknown: --record-bytes or --pack)"),
          flush=True)
    print(f"layer steps {'per token' if args.per_token else 'per engine step'}; pin-half is measured on the second "
          f"half (against Belady's hit rate on that half)")
    rows = []
    header = f"{'cache':>14} {'policy':>14} {'hit rate':>9} {'vs belady':>9} {'records/tok':>11} {'bytes/tok':>10}"
    for fraction in [float(f) for f in args.fractions.split(",")]:
        slots = slots_for(fraction, n_records)
        results = {spec: run_policy(trace, spec, slots, args.per_token) for spec in args.policies.split(",")}
        best = results.get("belady") or run_policy(trace, "belady", slots, args.per_token)
        best_second_half = run_policy(trace, "belady", slots, args.per_token, second_half=True)
        print(f"\n{header}")
        for spec, r in results.items():
            oracle = best_second_half if spec.startswith("pin-half") else best
            below = (oracle.hit_rate - r.hit_rate) * 100
            per_token_bytes = r.records_per_token * record_bytes if record_bytes else None
            row = {"fraction": fraction, "slots": slots, "policy": r.policy, "hits": r.hits, "misses": r.misses,
                   "tokens": r.tokens, "hit_rate": r.hit_rate, "points_below_belady": below,
                   "records_per_token": r.records_per_token, "bytes_per_token": per_token_bytes}
            rows.append(row)
            print(f"{fraction:6.1%} ({slots:3d} sl) {r.policy:>14} {r.hit_rate:9.1%} {below:8.1f}p "
                  f"{r.records_per_token:11.3f} {format_bytes_per_token(per_token_bytes) if per_token_bytes else '-':>10}",
                  flush=True)
        if args.validate:
            steps, _ = layer_steps(trace, slots, args.per_token)
            for policy in ("lru", "lfru", "lfu-decay", "next-use"):
                sim = simulate(steps, slots, make_policy(policy, slots, trace.moe_layers, trace.num_experts,
                                                         pack_requests_per_token(args.validate)))
                real = native_replay(args.validate, steps, slots, policy)
                gap = abs(sim.hit_rate - (real["hit_rate"] or 0.0)) * 100
                rows.append({"fraction": fraction, "slots": slots, "validate": policy, "simulated_hits": sim.hits,
                             "native_hits": real["hits"], "native_misses": real["misses"], "gap_points": gap})
                print(f"  validate {policy}: simulated {sim.hits} hits / {sim.misses} misses ({sim.hit_rate:.2%}), "
                      f"real cache {real['hits']} / {real['misses']} ({real['hit_rate'] or 0:.2%}): "
                      f"{gap:.2f} points apart{'' if gap <= 1 else '  <-- MORE THAN 1 POINT'}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
