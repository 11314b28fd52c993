"""AEPC benchmark: decode speed with routed experts streamed from disk through the slab cache.

    python bench/bench_aepc.py build /var/tmp/olmoe-q8.pack --quant q8_0      # OLMoE-1B-7B shape
    python bench/bench_aepc.py disk  /var/tmp/olmoe-q8.pack                   # O_DIRECT bandwidth
    python bench/bench_aepc.py run   /var/tmp/olmoe-q8.pack --fractions 0.25,0.5,1.0
    python bench/bench_aepc.py run   /var/tmp/olmoe-q8.pack --cgroup-limit 3G --fractions 0.25

`build` writes a pack of the real OLMoE-1B-7B dimensions (16 layers, 64 experts, top-8,
hidden 2048, expert ffn 1024, vocab 50304) with random quantized weights, directly in the
pack format (no checkpoint in between: 7 GB of f32 would not be quick to make).

`run` measures, per cache size (a fraction of the expert bytes) and policy: decode
tokens/s, hit rate, MB read per token, read bandwidth during decode next to the disk's
O_DIRECT bandwidth measured in the same run, and prefetch precision/recall. Prefetch is the
engine's lookahead (layer l+1's router applied to layer l's FFN input). `--cgroup-limit`
re-runs the measurement inside a child memory cgroup (v1) with that memory.limit_in_bytes.

`run --routing-trace TRACE` replays a trained model's routing on the pack instead of the
random router's (which has no locality): each decoded token takes the experts of the
trace's next decode step (bench/routing_traces.py; cycling through them), the pack's i-th MoE
layer those of the trace's layer i mod L (a 16-layer pack, an 8-layer trace: each trace layer
drives two pack layers), with the router's own mixing weights by rank
(colibrid/engine/routing_override.py). With prefetch on, the lookahead prefetches the
guesses the trace recorded (routing_traces.py --guesses), at the point the recording
predictor would (router-on-moe-input: once the layer's reads are done; router-on-residual:
once its experts have run), the first LOOKAHEAD_TOP of them as always; at the trace's wrap
(its last layer to its first) there are none and nothing is prefetched. A trace without
guesses replays with prefetch off (or oracle) only. `--prefetch oracle` hands the lookahead
the next layer's true experts instead, all top-k read ahead: the gain no next-layer predictor
can beat; `on:N` reads N guesses ahead a step. Reported per cache fraction x policy x prefetch:
tok/s, hit rate, expert records read per token, and the disk's busy share (the loader's
time with a read in flight over the run's time). `--alternate N` runs the prefetch modes side
by side, each with its own cache, in turns of N tokens, so that this machine's drift falls on
all of them alike; ratios are then printed against the first mode.

    python bench/routing_traces.py /tmp/stdlib64-guesses.jsonl --model models/colibri-olmoe64-stdlib \
        --guesses router-on-residual
    python bench/bench_aepc.py run /var/tmp/olmoe-q8.pack --routing-trace /tmp/stdlib64-guesses.jsonl \
        --fractions 0.25,0.5 --policies lfu-decay --prefetch off,on --tokens 64 --warmup 16
    python bench/bench_aepc.py run /var/tmp/olmoe-q8.pack --routing-trace /tmp/stdlib64-guesses.jsonl \
        --fractions 0.25 --policies next-use --prefetch off,on,oracle --tokens 192 --warmup 32 --alternate 8

`policies` compares the cache policies on real routing: the trained default model
(models/colibri-olmoe-stdlib) decodes its held-out validation text token by token, and the
cache's hit rate is reported per size and policy.

`trace-record` subscribes to a running daemon's routing stream (docs/protocol.md) and writes
what it gets to a JSON-lines trace; `trace-replay` reads the experts each MoE layer step
needs from a trace, in order, through the expert cache at several sizes and policies, with
no model to compute: the cache's hit rate and reads on real serving traffic. A trace is the
recorder's file or the output of `colibrictl ask --json --debug-routing` (one step per token).

    python bench/bench_aepc.py trace-record /tmp/trace.jsonl --socket /run/colibri/colibrid.sock --seconds 60
    python bench/bench_aepc.py trace-replay /var/tmp/olmoe-q8.pack /tmp/trace.jsonl --fractions 0.25,0.5

`versus` runs llama.cpp (llama-bench, its default mmap loading) on a GGUF of the same model
and Colibri on the pack, one after the other inside the same memory cgroup limit (default
40 % of the pack), each starting with its files evicted from the page cache, and prints
the decode ratio. Colibri's cache gets what the limit leaves after the dense weights and a
fixed allowance for the process itself.

Not a test: numbers depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # also when loaded by path (tests/engine/experts/test_cache.py)

from colibrid import native  # noqa: E402
from colibrid.sizes import format_bytes  # noqa: E402
from colibrid.system.memory import parse_size  # noqa: E402
from memory_cgroup import (  # noqa: E402
    drop_from_page_cache, evict_from_page_cache, run_in_memory_cgroup,
)

OLMOE_SHAPE = dict(num_layers=16, num_experts=64, top_k=8, hidden=2048, ffn=1024, vocab=50304, heads=16, kv_heads=16)


# --------------------------------------------------------------------------------------------
# A pack of a given shape, random quantized weights
# --------------------------------------------------------------------------------------------


def _random_blocks(rng: np.random.Generator, type_: native.TensorType, rows: int, cols: int, std: float) -> np.ndarray:
    """Encoded bytes (rows, row_bytes) of a random matrix, made block by block without
    going through float32 (q8_0: uniform int8 codes; q4_g64: uniform nibbles around 0)."""
    if type_ is native.TensorType.F32:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * std).view(np.uint8).reshape(rows, -1)
    n_blocks = rows * cols // type_.block_elems
    if type_ is native.TensorType.Q8_0:
        blocks = np.frombuffer(rng.bytes(n_blocks * 34), dtype=np.uint8).reshape(n_blocks, 34).copy()
        d = np.float16(std / 73.0)  # uniform int8 codes: std = 73 d
        blocks[:, 0:2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
    elif type_ is native.TensorType.Q4_G64:
        blocks = np.frombuffer(rng.bytes(n_blocks * 36), dtype=np.uint8).reshape(n_blocks, 36).copy()
        d = np.float16(std / 4.6)  # uniform 0..15 codes: std = 4.6 d
        blocks[:, 0:2] = np.frombuffer(d.tobytes(), dtype=np.uint8)
        blocks[:, 2:4] = np.frombuffer(np.float16(-7.5 * float(d)).tobytes(), dtype=np.uint8)
    else:
        raise ValueError(f"no random generator for {type_.name_in_pack}")
    return blocks.reshape(rows, type_.row_bytes(cols))


def build_shaped_pack(out: Path, num_layers: int, num_experts: int, top_k: int, hidden: int, ffn: int, vocab: int,
                      heads: int, kv_heads: int, quant: str = "q8_0", dense_quant: str = "q8_0", seed: int = 0,
                      force: bool = True) -> Path:
    """Writes an OLMoE-architecture pack of this shape; returns its path."""
    from colibrid.models.model_config import ModelConfig
    from colibrid.models.optional_tensors import OPTIONAL_TENSORS
    from colibrid.pack.writer import PackWriter

    out = Path(out)
    rng = np.random.default_rng(seed)
    et, dt = native.TensorType.from_name(quant), native.TensorType.from_name(dense_quant)
    f32 = native.TensorType.F32
    head_dim = hidden // heads
    with tempfile.TemporaryDirectory(prefix="aepc-template-") as tmp:
        template = Path(tmp) / "demo.pack"
        subprocess.run([sys.executable, "-m", "colibrid.tools.demo", str(template), "--force"], check=True,
                       capture_output=True, cwd=ROOT)
        manifest = json.loads((template / "manifest.json").read_text())
        # The model section also states the optional tensors (flags, not ModelConfig fields): the
        # random pack written here has none of them.
        model = {key: value for key, value in manifest["model"].items() if key not in OPTIONAL_TENSORS}
        model.update(vocab_size=vocab, hidden_size=hidden, num_layers=num_layers, num_heads=heads, num_kv_heads=kv_heads,
                     head_dim=head_dim, num_experts=num_experts, num_experts_per_tok=top_k, expert_ffn=ffn,
                     sliding_window=[None] * num_layers, moe_layers=[True] * num_layers)
        config = ModelConfig.from_json(model)
        with PackWriter(out, 4096, force) as writer:
            def dense(name, type_, shape, std=0.02):
                writer.add_dense(name, type_, shape, _random_blocks(rng, type_, shape[0], shape[1], std))

            def ones(name, n):
                writer.add_dense(name, f32, (n,), np.ones(n, dtype=np.float32))

            dense("embed", dt, (vocab, hidden), std=1.0)
            ones("final_norm", hidden)
            dense("lm_head", dt, (vocab, hidden))
            for layer in range(num_layers):
                p = f"layers.{layer}."
                ones(p + "attn_norm", hidden)
                ones(p + "ffn_norm", hidden)
                dense(p + "attn.q", dt, (heads * head_dim, hidden))
                dense(p + "attn.k", dt, (kv_heads * head_dim, hidden))
                dense(p + "attn.v", dt, (kv_heads * head_dim, hidden))
                dense(p + "attn.o", dt, (hidden, heads * head_dim))
                ones(p + "attn.q_norm", heads * head_dim)
                ones(p + "attn.k_norm", kv_heads * head_dim)
                dense(p + "router", f32, (num_experts, hidden), std=0.05)
            for layer in range(num_layers):
                for expert in range(num_experts):
                    writer.add_expert(layer, expert, {
                        "gate": (et, (ffn, hidden), _random_blocks(rng, et, ffn, hidden, 0.02)),
                        "up": (et, (ffn, hidden), _random_blocks(rng, et, ffn, hidden, 0.02)),
                        "down": (et, (hidden, ffn), _random_blocks(rng, et, hidden, ffn, 0.02)),
                    })
                print(f"  layer {layer + 1}/{num_layers} written", file=sys.stderr, flush=True)
            names = []
            for name in manifest["tokenizer_files"]:
                writer.add_file(template / name, name)
                names.append(name)
            writer.commit(dict(model=config, quantization={"experts": quant, "dense": dense_quant, "embeddings": dense_quant},
                               tokenizer_files=names, source={"model_type": "olmoe", "synthetic": True},
                               producer="bench_aepc.py"))
    return out


# --------------------------------------------------------------------------------------------
# Disk bandwidth (O_DIRECT, the loader's own threads)
# --------------------------------------------------------------------------------------------


def measure_disk(pack_path: Path, queue_depth: int = 16, seconds: float = 4.0, seed: int = 1) -> dict:
    """O_DIRECT read bandwidth of random whole expert records at ``queue_depth``."""
    from colibrid.engine.experts.slab import expert_slot_bytes
    from colibrid.pack.experts_region import experts_region
    from colibrid.pack.manifest import Manifest

    # The manifest only: Pack.open would read all of dense.bin into memory, for nothing here.
    manifest = Manifest.read(Path(pack_path))
    records = manifest.expert_records
    slot = expert_slot_bytes(manifest)
    slab = native.Slab(slot, queue_depth * 2, hugetlb=native.AepcMode.OFF, lock=native.AepcMode.OFF)
    loader = native.Loader(experts_region(Path(pack_path), manifest).path, queue_depth=queue_depth,
                           max_queue_depth=max(32, queue_depth))
    rng = np.random.default_rng(seed)
    total, start = 0, time.perf_counter()
    try:
        while time.perf_counter() - start < seconds:
            batch = [records[int(i)] for i in rng.choice(len(records), size=queue_depth * 2, replace=False)]
            reqs = [(slab.data[i * slot:(i + 1) * slot], r.offset, r.length, r.crc32c) for i, r in enumerate(batch)]
            status, _ = loader.read(reqs)
            if status:
                raise RuntimeError(f"disk measurement: read failed with status {status}")
            total += sum(r.length for r in batch)
        elapsed = time.perf_counter() - start
        direct = bool(loader.info()["direct"])
    finally:
        loader.close()
        slab.close()
    return {"bytes": total, "seconds": elapsed, "gb_per_s": total / elapsed / 1e9, "queue_depth": queue_depth,
            "record_bytes": slot, "direct": direct}


# --------------------------------------------------------------------------------------------
# Decode measurement
# --------------------------------------------------------------------------------------------


PREFETCH_MODES = ("off", "on", "on:N", "oracle")


def prefetch_mode(text: str) -> tuple[str, int | None]:
    """("off" | "on" | "oracle", guesses read ahead a step or None for the engine's
    LOOKAHEAD_TOP) from "off", "on", "on:N" or "oracle"."""
    kind, _, top = text.partition(":")
    if kind in ("off", "oracle") and not top:
        return kind, None
    if kind == "on" and (not top or (top.isdigit() and int(top) >= 1)):
        return kind, int(top) if top else None
    raise ValueError(f"prefetch must be one of {', '.join(PREFETCH_MODES)} (N >= 1), got {text!r}")


class DecodeRun:
    """One configuration's decode (cache size, policy, prefetch mode), stepped a few tokens at
    a time, so that several can take turns in one process (run --alternate).

    ``prefetch``: "off"; "on", the engine's lookahead ("on:N": reading N guesses ahead a step
    instead of LOOKAHEAD_TOP); or "oracle" (replaying a trace only: the lookahead's guesses are
    the next layer's true experts, all top-k read ahead, so its gain over "off" bounds what
    any next-layer predictor can gain). ``replay``: a routing_traces.DecodeSteps whose routing
    (and guesses) every token replays."""

    def __init__(self, pack_path: Path, cache_bytes: int, policy: str, prefetch: str, queue_depth: int,
                 max_tokens: int, seed: int = 0, feed: str = "random", hugepages: str = "auto", replay=None) -> None:
        from colibrid.engine.engine import Engine
        from colibrid.engine.experts.cache import CachedExpertSource
        from colibrid.engine.routing_override import RoutingOverride
        from colibrid.pack.reader import Pack
        from colibrid.system.cache_memory import MachineMemory

        kind, lookahead_top = prefetch_mode(prefetch)
        if kind == "oracle" and replay is None:
            raise ValueError("prefetch oracle needs a replayed routing trace: its guesses are the trace's next layer")
        self.prefetch, self.oracle, self.policy, self.feed, self.replay = prefetch, kind == "oracle", policy, feed, replay
        self.pack = Pack.open(pack_path)
        self.source = CachedExpertSource(self.pack, cache_bytes, policy=policy, io_queue_depth=queue_depth,
                                         hugepages=hugepages, lock_memory="try", prefetch=kind != "off",
                                         memory=MachineMemory())  # the daemon's: hugepages as it gets them
        try:
            # With prefetch on, each MoE layer predicts the next one's experts (replaying: the trace's guesses,
            # when the recording predictor would have made them)
            predictor = replay.predictor if replay is not None and replay.predictor else "router-on-moe-input"
            self.engine = Engine(self.pack, experts=self.source, lookahead_predictor=predictor)
            self.override = None
            if replay is not None:
                self.override = RoutingOverride.for_model(self.engine.model, trace_layers=replay.layers)
                self.override.install(self.engine.model)
            if kind == "oracle":
                lookahead_top = self.pack.manifest.model.num_experts_per_tok
            if lookahead_top is not None:
                for layer in self.engine.model.layers:
                    if layer.moe is not None:
                        layer.moe.lookahead_top = lookahead_top
            self.session = self.engine.new_session(max_context=max_tokens + 16)
        except BaseException:
            self.source.close()
            raise
        self.noncache_after_load_bytes = self.noncache_resident_bytes()  # before the cache fills
        self.rng = np.random.default_rng(seed)
        self.vocab = self.engine.config.vocab_size
        self.token = int(self.rng.integers(0, self.vocab))
        self.steps_run = 0
        self.tokens = 0
        self.elapsed = 0.0

    def noncache_resident_bytes(self) -> int:
        """This process' resident bytes less what of the expert cache's slab is resident."""
        from colibrid.native import resident_bytes
        from colibrid.system.residency import process_rss_bytes

        return process_rss_bytes() - max(resident_bytes(self.source.region), 0)

    def _step(self) -> None:
        if self.override is not None:  # the trace's next decode step, cycling
            replay = self.replay
            i = self.steps_run % replay.experts.shape[0]
            experts = replay.experts[i]
            if self.oracle:
                guesses = self.override.oracle_guesses(experts)
            else:
                guesses = None if replay.guesses is None else replay.guesses[i]
            self.override.set_step(experts[:, None, :], None if guesses is None else guesses[:, None, :])
        self.steps_run += 1
        greedy = int(np.argmax(self.session.forward([self.token], all_logits=False)[-1]))
        # A random-weight model's greedy output soon repeats one token, and with it the same
        # experts: feeding random tokens instead gives the random routing the targets assume.
        self.token = greedy if self.feed == "greedy" else int(self.rng.integers(0, self.vocab))

    def warm(self, tokens: int) -> None:
        """Fills the cache (all of it, if it has a slot for every record; else by decoding
        ``tokens``), waits for its reads, and zeroes the counters."""
        records = self.pack.manifest.expert_records
        if self.source.n_slots >= len(records):  # the cache holds every expert: load them all first
            for layer in self.pack.manifest.model.moe_layer_ids:
                with self.source.acquire(layer, range(self.pack.manifest.model.num_experts)):
                    pass
        for _ in range(tokens):
            self._step()
        self.wait_for_reads()
        self.source.reset_stats()
        self._loader0 = self.source.stats()["loader"]

    def advance(self, tokens: int) -> None:
        """Decodes ``tokens`` more, timed; then waits (untimed) for the prefetches still in
        flight, so that none reads during another configuration's turn."""
        start = time.perf_counter()
        for _ in range(tokens):
            self._step()
        self.elapsed += time.perf_counter() - start
        self.tokens += tokens
        self.wait_for_reads()

    def wait_for_reads(self, timeout_s: float = 60.0) -> None:
        """Until every read the cache started has completed (prefetches are never waited for
        otherwise). The counters say so: each read started is a miss or a prefetch issued,
        and ends as a load or a load failure."""
        deadline = time.perf_counter() + timeout_s
        while True:
            total = self.source.stats()["total"]
            if total["loads"] + total["load_failures"] >= total["misses"] + total["prefetch_issued"]:
                return
            if time.perf_counter() > deadline:
                raise RuntimeError(f"expert reads still in flight after {timeout_s:.0f} s")
            time.sleep(0.001)

    def result(self) -> dict:
        st = self.source.stats()
        total = st["total"]
        busy_s = (st["loader"]["busy_ns"] - self._loader0["busy_ns"]) / 1e9
        tokens, elapsed, source = self.tokens, self.elapsed, self.source
        return {
            "cache_bytes": source.n_slots * source.slot_bytes, "slots": source.n_slots, "policy": self.policy,
            "prefetch": self.prefetch, "tokens": tokens, "tok_per_s": tokens / elapsed,
            "hit_rate": total["hit_rate"], "mb_read_per_token": total["bytes_read"] / tokens / 1e6,
            "records_read_per_token": total["bytes_read"] / source.slot_bytes / tokens,
            "read_gb_per_s": total["bytes_read"] / elapsed / 1e9, "disk_busy_fraction": busy_s / elapsed,
            "read_ms_p50": total["read_ms_p50"], "read_ms_p99": total["read_ms_p99"],
            "prefetch_issued": total["prefetch_issued"], "prefetch_useful": total["prefetch_useful"],
            "prediction_precision": total["prediction_precision"], "prediction_recall": total["prediction_recall"],
            "backing": source.backing_info()["backing"], "direct": source.backing_info()["direct"],
            "noncache_after_load_bytes": self.noncache_after_load_bytes,
            "noncache_after_decode_bytes": self.noncache_resident_bytes(),
        }

    def close(self) -> None:
        self.source.close()


def decode_run(pack_path: Path, cache_bytes: int, policy: str, prefetch: str, tokens: int, warmup: int,
               queue_depth: int, seed: int = 0, feed: str = "random", hugepages: str = "auto", replay=None) -> dict:
    """One configuration alone: ``warmup`` tokens to fill the cache, then ``tokens`` timed."""
    run = DecodeRun(pack_path, cache_bytes, policy, prefetch, queue_depth, warmup + tokens, seed=seed, feed=feed,
                    hugepages=hugepages, replay=replay)
    try:
        run.warm(warmup)
        run.advance(tokens)
        return run.result()
    finally:
        run.close()


def alternate_runs(runs: list[DecodeRun], tokens: int, warmup: int, turn: int, seed: int = 0) -> list[dict]:
    """Several configurations side by side: each warms up, then they take turns of ``turn``
    tokens, in a fresh random order each round, until each has decoded ``tokens``. This
    machine's speed drifts by a third within minutes; taking turns puts the drift on every
    configuration alike, where runs one after another compare different minutes."""
    for run in runs:
        run.warm(warmup)
    rng = np.random.default_rng(seed)
    while runs[0].tokens < tokens:
        n = min(turn, tokens - runs[0].tokens)
        for i in rng.permutation(len(runs)):
            runs[i].advance(n)
    return [run.result() for run in runs]


def _routing_trace(path: Path, pack, prefetches: list[str]):
    """The trace's decode steps, checked against the pack, with what replaying them means printed."""
    from colibrid.engine.forward.moe import LOOKAHEAD_TOP
    from routing_traces import read_decode_steps

    config = pack.manifest.model
    replay = read_decode_steps(path, config.num_experts, config.num_experts_per_tok)
    kinds = {prefetch_mode(p)[0] for p in prefetches}
    if "on" in kinds and replay.guesses is None:
        raise SystemExit(f"{path} records no lookahead guesses, and the random router's would say nothing about the "
                         f"replayed routing: record one with bench/routing_traces.py --guesses router-on-residual "
                         f"(or router-on-moe-input), or run with --prefetch off (or oracle)")
    moe_layers = len(config.moe_layer_ids)
    print(f"routing from {path}: {replay.experts.shape[0]} decode steps of {replay.layers} MoE layers, cycled; "
          f"the pack's MoE layer i replays trace layer i mod {replay.layers} ({moe_layers} pack MoE layers); "
          f"mixing weights: the router's own by rank", flush=True)
    if replay.guesses is not None and "on" in kinds:
        print(f"lookahead guesses from the trace: {replay.predictor}, the first {LOOKAHEAD_TOP} (on:N: N) of "
              f"{replay.guesses.shape[2]} recorded per row; none at the trace's wrap (trace layer {replay.layers - 1} "
              f"-> 0)", flush=True)
    if "oracle" in kinds:
        print(f"prefetch oracle: the lookahead reads ahead the next layer's true experts, all "
              f"{config.num_experts_per_tok}, at the point the engine's own guesses are read; none at the wrap",
              flush=True)
    return replay


def _run_group(args, replay, cache_bytes: int, policy: str, prefetches: list[str]) -> list[dict]:
    """The prefetch modes at one cache size and policy: one after another, or (--alternate)
    taking turns, each with a cache of its own."""
    if not args.alternate:
        return [decode_run(args.pack, cache_bytes, policy, prefetch, args.tokens, args.warmup, args.queue_depth,
                           feed=args.feed, hugepages=args.hugepages, replay=replay) for prefetch in prefetches]
    runs: list[DecodeRun] = []
    try:
        for prefetch in prefetches:
            runs.append(DecodeRun(args.pack, cache_bytes, policy, prefetch, args.queue_depth, args.warmup + args.tokens,
                                  feed=args.feed, hugepages=args.hugepages, replay=replay))
        return alternate_runs(runs, args.tokens, args.warmup, args.alternate)
    finally:
        for run in runs:
            run.close()


def _rss_peak_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cmd_run(args) -> int:
    from types import SimpleNamespace

    from colibrid.pack.manifest import Manifest

    if args.threads:
        native.configure_default_pool(n_threads=args.threads)
    # The manifest only: a Pack.open here held a second copy of dense.bin (each DecodeRun
    # opens its own) for the whole run: 489 MiB of the 547 MiB over dense + cache the issue saw.
    manifest = Manifest.read(Path(args.pack))
    pack = SimpleNamespace(manifest=manifest)  # what _routing_trace reads
    expert_bytes = sum(r.length for r in manifest.expert_records)
    print(f"pack {args.pack}: experts {format_bytes(expert_bytes)}, dense {format_bytes(manifest.dense_size)}")
    prefetches = args.prefetch.split(",")
    try:
        kinds = {prefetch_mode(p)[0] for p in prefetches}
    except ValueError:
        raise SystemExit(f"--prefetch takes {', '.join(PREFETCH_MODES)} (comma-separated), got {args.prefetch!r}") from None
    if "oracle" in kinds and not args.routing_trace:
        raise SystemExit("--prefetch oracle needs --routing-trace: its guesses are the trace's next layer")
    replay = _routing_trace(args.routing_trace, pack, prefetches) if args.routing_trace else None  # refused before measuring
    disk = measure_disk(args.pack, queue_depth=args.queue_depth)
    print(f"disk: {disk['gb_per_s']:.2f} GB/s O_DIRECT (records of {format_bytes(disk['record_bytes'])}, "
          f"queue depth {disk['queue_depth']}, direct={disk['direct']})")
    if args.alternate:
        print(f"the prefetch modes take turns of {args.alternate} tokens in one process, each with its own cache")
    rows = []
    fractions = [args.cache_bytes / expert_bytes] if args.cache_bytes else [float(f) for f in args.fractions.split(",")]
    for fraction in fractions:
        for policy in args.policies.split(","):
            group = _run_group(args, replay, int(expert_bytes * fraction), policy, prefetches)
            for row in group:
                row.update(fraction=fraction, disk_gb_per_s=disk["gb_per_s"],
                           read_vs_disk=row["read_gb_per_s"] / disk["gb_per_s"],
                           vs_first=row["tok_per_s"] / group[0]["tok_per_s"])
                rows.append(row)
                print(f"cache {fraction:4.0%} {policy:4s} prefetch {row['prefetch']:6s}: "
                      f"{row['tok_per_s']:6.2f} tok/s" + (f" ({row['vs_first']:.3f}x)" if args.alternate else "") +
                      f"  hit {row['hit_rate'] or 0:5.1%}  "
                      f"{row['mb_read_per_token']:7.1f} MB/tok ({row['records_read_per_token']:.2f} records)  read {row['read_gb_per_s']:.2f} GB/s "
                      f"({row['read_vs_disk']:.0%} of disk, busy {row['disk_busy_fraction']:.0%})  "
                      f"p50 {row['read_ms_p50']} ms  precision {row['prediction_precision']}", flush=True)
    peak = _rss_peak_bytes()
    # The cache is locked (all resident) when it can be; one cache at a time unless --alternate.
    caches = sum(row["cache_bytes"] for row in rows) if args.alternate else max(row["cache_bytes"] for row in rows)
    result = {"disk": disk, "runs": rows, "peak_rss_bytes": peak, "noncache_peak_bytes": peak - caches}
    if replay is not None:
        result["routing_trace"] = {"path": str(args.routing_trace), "decode_steps": int(replay.experts.shape[0]),
                                   "trace_layers": replay.layers, "guesses": replay.header.get("guesses")}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


# --------------------------------------------------------------------------------------------
# Cache policies on real routing (the trained default model, teacher-forced over real text)
# --------------------------------------------------------------------------------------------


def validation_text_ids(tokenizer, limit: int) -> list[int]:
    """The default model's held-out validation files (tools/train_default_model.py), tokenized."""
    sys.path.insert(0, str(ROOT / "tools"))
    from train_default_model import is_validation, stdlib_files

    root, files = stdlib_files()
    ids: list[int] = []
    for path in files:
        if is_validation(str(path.relative_to(root))):
            ids += tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=True)
            if len(ids) >= limit:
                break
    return ids[:limit]


def replay_routing(pack_path: Path, ids: list[int], cache_bytes: int, policy: str, prefetch: bool,
                   document: int) -> dict:
    """Decodes ``ids`` one token at a time (teacher-forced, a new sequence every ``document``
    tokens, the cache kept across them) and returns the cache's hit rate and reads."""
    from colibrid.engine.engine import Engine
    from colibrid.engine.experts.cache import CachedExpertSource
    from colibrid.pack.reader import Pack

    pack = Pack.open(pack_path)
    source = CachedExpertSource(pack, cache_bytes, policy=policy, io_queue_depth=16, hugepages="off",
                                lock_memory="off", prefetch=prefetch)
    try:
        engine = Engine(pack, experts=source)
        for start in range(0, len(ids), document):
            session = engine.new_session(max_context=document + 1)
            for token in ids[start : start + document]:
                session.forward([token], all_logits=False)
        total = source.stats()["total"]
        return {"policy": policy, "prefetch": prefetch, "slots": source.n_slots, "hit_rate": total["hit_rate"],
                "records_read_per_token": total["bytes_read"] / source.slot_bytes / len(ids),
                "prediction_precision": total["prediction_precision"]}
    finally:
        source.close()


def cmd_policies(args) -> int:
    from colibrid.engine.text.tokenizer import Tokenizer
    from colibrid.pack.reader import Pack

    pack = Pack.open(args.pack)
    records = pack.manifest.expert_records
    ids = validation_text_ids(Tokenizer.from_dir(args.pack), args.tokens)
    print(f"{args.pack}: {len(records)} expert records; {len(ids)} validation tokens, "
          f"sequences of {args.document}", flush=True)
    rows = []
    for fraction in [float(f) for f in args.fractions.split(",")]:
        for prefetch in [p == "on" for p in args.prefetch.split(",")]:
            for policy in args.policies.split(","):
                cache_bytes = int(sum(r.length for r in records) * fraction)
                row = {"fraction": fraction, **replay_routing(args.pack, ids, cache_bytes, policy, prefetch, args.document)}
                rows.append(row)
                print(f"cache {fraction:4.0%} ({row['slots']} slots) {policy:4s} prefetch {'on ' if prefetch else 'off'}: "
                      f"hit {row['hit_rate']:.1%}, {row['records_read_per_token']:.2f} records read per token, "
                      f"prediction precision {row['prediction_precision']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


# --------------------------------------------------------------------------------------------
# Routing traces: recorded from a running daemon, replayed through the cache
# --------------------------------------------------------------------------------------------


def record_trace(socket_path: str, out: Path, seconds: float | None, steps: int | None) -> int:
    """Writes the `subscribed` event, then each `routing` event, one JSON object a line, until
    ``seconds`` have passed or ``steps`` summaries came; returns the summaries written. A
    summary the daemon dropped for us (we were slow) is counted in the next one's `dropped`."""
    import threading

    from colibrid.wire.client import Connection
    from colibrid.wire.errors import ClientError
    from colibrid.wire.events import RoutingEvent

    written, deadline_s = 0, None if seconds is None else time.monotonic() + seconds
    with Connection.open(socket_path, client_name="bench_aepc trace-record") as connection, open(out, "w") as f:
        # An idle daemon sends nothing: at the deadline the connection is closed under the read.
        timer = threading.Timer(seconds, connection.close) if seconds is not None else None
        request_id = connection.subscribe("routing")
        if timer is not None:
            timer.start()
        try:
            for event in connection.events(request_id):
                f.write(json.dumps(event.to_wire()) + "\n")
                written += isinstance(event, RoutingEvent)
                if steps is not None and written >= steps:
                    break
        except ClientError:
            if deadline_s is None or time.monotonic() < deadline_s:
                raise  # the daemon went away, not our deadline
        finally:
            if timer is not None:
                timer.cancel()
    return written


def read_trace(path: Path) -> list[list[tuple[int, list[int]]]]:
    """The trace's steps, each the (layer, experts needed) of every MoE layer in order: from the
    recorder's `routing` events, or from `ask --debug-routing --json` token lines (that
    token's experts, one step each). Other lines are skipped."""
    steps = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        event = json.loads(line)
        if event.get("event") == "routing":
            steps.append([(int(entry["layer"]), [int(e) for e in entry["experts"]]) for entry in event["layers"]])
        elif event.get("event") == "token" and isinstance(event.get("routing"), dict):
            routing = event["routing"]
            steps.append([(int(layer), sorted({int(e) for e in experts}))
                          for layer, experts in zip(routing["layers"], routing["experts"])])
    return steps


def replay_trace(pack_path: Path, steps: list[list[tuple[int, list[int]]]], cache_bytes: int, policy: str) -> dict:
    """Acquires each step's experts layer by layer (in waves of the cache's pinnable slots, as
    the engine does) and returns the cache's hit rate and reads."""
    from colibrid.engine.experts.cache import CachedExpertSource
    from colibrid.pack.reader import Pack

    pack = Pack.open(pack_path)
    config = pack.manifest.model
    moe_layers = set(config.moe_layer_ids)
    for step in steps:
        for layer, experts in step:
            if layer not in moe_layers or any(not 0 <= e < config.num_experts for e in experts):
                raise SystemExit(f"the trace names layer {layer} experts {experts}, which {pack_path} does not have "
                                 f"(MoE layers {sorted(moe_layers)}, {config.num_experts} experts): another model's trace?")
    source = CachedExpertSource(pack, cache_bytes, policy=policy, io_queue_depth=16, hugepages="off",
                                lock_memory="off", prefetch=False)
    try:
        start = time.perf_counter()
        for step in steps:
            for layer, experts in step:
                for first in range(0, len(experts), source.max_pinned):
                    wave = experts[first:first + source.max_pinned]
                    with source.acquire(layer, wave) as acquired:
                        for expert in wave:
                            acquired[expert]  # waits for its read, as the engine's use of it would
        elapsed = time.perf_counter() - start
        total = source.stats()["total"]
        return {"policy": policy, "slots": source.n_slots, "steps": len(steps), "hit_rate": total["hit_rate"],
                "hits": total.get("hits", 0) + total.get("inflight_hits", 0), "misses": total.get("misses", 0),
                "bytes_read": total.get("bytes_read", 0), "seconds": elapsed,
                "read_gb_per_s": total.get("bytes_read", 0) / elapsed / 1e9 if elapsed > 0 else 0.0}
    finally:
        source.close()


def cmd_trace_replay(args) -> int:
    from colibrid.pack.reader import Pack

    steps = read_trace(args.trace)
    if not steps:
        raise SystemExit(f"{args.trace} holds no routing steps")
    expert_bytes = sum(r.length for r in Pack.open(args.pack).manifest.expert_records)
    print(f"{args.trace}: {len(steps)} steps, replayed on {args.pack} (experts {format_bytes(expert_bytes)})", flush=True)
    rows = []
    for fraction in [float(f) for f in args.fractions.split(",")]:
        for policy in args.policies.split(","):
            row = {"fraction": fraction, **replay_trace(args.pack, steps, int(expert_bytes * fraction), policy)}
            rows.append(row)
            print(f"cache {fraction:4.0%} ({row['slots']} slots) {policy:4s}: hit {row['hit_rate'] or 0:.1%}, "
                  f"{row['misses']} records read ({format_bytes(row['bytes_read'])}, "
                  f"{row['read_gb_per_s']:.2f} GB/s)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


# --------------------------------------------------------------------------------------------
# Side by side with llama.cpp under one memory limit
# --------------------------------------------------------------------------------------------

LLAMA_BENCH = Path.home() / ".cache/colibri-bench/llama.cpp/build/bin/llama-bench"


def llama_decode_in_cgroup(gguf: Path, limit: int, tokens: int, threads: int, extra: list[str]) -> dict:
    """llama-bench's decode rate inside the limit; 0 tok/s if the cgroup's OOM killer ends it
    (with Q4_0 its CPU backend repacks the weights into anonymous memory, which mmap cannot
    give back: pass --repack 0 through ``extra`` to keep them file-backed)."""
    evict_from_page_cache(gguf)
    argv = [str(LLAMA_BENCH), "-m", str(gguf), "-p", "0", "-n", str(tokens), "-t", str(threads), "-r", "1",
            "-o", "json", *extra]
    run = run_in_memory_cgroup(limit, argv, capture=True)
    if run["code"] == -9:
        print("llama.cpp was killed by the cgroup's OOM killer", flush=True)
        return {**run, "tok_per_s": 0.0, "stdout": None, "oom_killed": True}
    if run["code"] != 0:
        raise RuntimeError(f"llama-bench failed with exit code {run['code']}")
    (test,) = json.loads(run["stdout"])
    return {**run, "tok_per_s": float(test["avg_ts"]), "stdout": None}


def _run_argv(pack_path: Path, cache_bytes: int, tokens: int, warmup: int, queue_depth: int, policy: str,
              threads: int, prefetch: str, out: Path) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "run", str(pack_path), "--cache-bytes", str(cache_bytes),
            "--policies", policy, "--prefetch", prefetch, "--tokens", str(tokens), "--warmup", str(warmup),
            "--queue-depth", str(queue_depth), "--threads", str(threads), "--json", str(out),
            # hugetlb pages are not charged to a v1 memory cgroup: the cache must be, to be fair
            "--hugepages", "off"]


def colibri_sizing(pack_path: Path, limit: int, tokens: int, warmup: int, queue_depth: int, threads: int) -> dict:
    """Colibri's cache for ``limit`` (versus_memory.py): the process' non-cache resident bytes
    measured by a probe run with one layer's worth of slots, outside the cgroup; or
    LimitTooSmall, saying why."""
    from colibrid.engine.experts.slab import expert_slot_bytes
    from colibrid.pack.manifest import Manifest
    from versus_memory import kv_cache_bytes, versus_cache_bytes

    manifest = Manifest.read(Path(pack_path))
    config = manifest.model
    slot, min_slots = expert_slot_bytes(manifest), config.num_experts_per_tok
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "probe.json"
        argv = _run_argv(pack_path, min_slots * slot, 2, 1, queue_depth, "lru", threads, "off", out)
        probe = subprocess.run(argv, stdout=subprocess.DEVNULL)
        if probe.returncode != 0:
            raise SystemExit(f"the Colibri probe run (measuring its non-cache memory) failed with exit code "
                             f"{probe.returncode}")
        measured = json.loads(out.read_text())
    noncache = measured["noncache_peak_bytes"]
    kv = kv_cache_bytes(config.num_layers, config.num_kv_heads, config.head_dim, tokens + warmup + 16)
    cache = versus_cache_bytes(limit, noncache, kv, slot, min_slots)
    print(f"colibri sizing: the process needs {format_bytes(noncache)} besides its cache (measured by a probe run: "
          f"dense {format_bytes(manifest.dense_size)} + rest {format_bytes(noncache - manifest.dense_size)}), KV "
          f"{format_bytes(kv)}; expert cache {format_bytes(cache)}", flush=True)
    return {"noncache_bytes": noncache, "kv_bytes": kv, "cache_bytes": cache, "dense_bytes": manifest.dense_size}


def colibri_decode_in_cgroup(pack_path: Path, limit: int, sizing: dict, tokens: int, warmup: int, queue_depth: int,
                             policy: str, threads: int, prefetch: str) -> dict:
    from versus_memory import oom_message

    drop_from_page_cache(pack_path)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        argv = _run_argv(pack_path, sizing["cache_bytes"], tokens, warmup, queue_depth, policy, threads, prefetch, out)
        run = run_in_memory_cgroup(limit, argv)
        if run["code"] == -9:
            raise SystemExit(oom_message(limit, sizing["dense_bytes"], sizing["noncache_bytes"], sizing["kv_bytes"],
                                         sizing["cache_bytes"], run))
        if run["code"] != 0:
            raise SystemExit(f"the Colibri run failed with exit code {run['code']}")
        measured = json.loads(out.read_text())
        (row,) = measured["runs"]
    return {**run, **row, "noncache_peak_bytes": measured["noncache_peak_bytes"]}


def cmd_versus(args) -> int:
    size = sum(f.stat().st_size for f in Path(args.pack).iterdir() if f.is_file())
    limit = parse_size(args.limit) if args.limit else int(size * args.limit_fraction)
    print(f"pack {format_bytes(size)}; memory limit {format_bytes(limit)} ({limit / size:.0%} of the pack); "
          f"{args.threads} threads", flush=True)
    sizing = colibri_sizing(args.pack, limit, args.tokens, args.warmup, args.queue_depth, args.threads)  # or refuses
    llama = llama_decode_in_cgroup(args.gguf, limit, args.llama_tokens, args.threads, args.llama_args.split())
    print(f"llama.cpp (mmap): {llama['tok_per_s']:.2f} tok/s", flush=True)
    colibri = colibri_decode_in_cgroup(args.pack, limit, sizing, args.tokens, args.warmup, args.queue_depth, args.policy,
                                       args.threads, args.prefetch)
    print(f"colibri ({format_bytes(colibri['cache_bytes'])} expert cache, {args.policy}, prefetch {args.prefetch}): "
          f"{colibri['tok_per_s']:.2f} tok/s, hit {colibri['hit_rate']:.1%}, "
          f"{colibri['mb_read_per_token']:.0f} MB/token, {colibri['read_gb_per_s']:.2f} GB/s", flush=True)
    if llama["tok_per_s"]:
        print(f"ratio colibri / llama.cpp: {colibri['tok_per_s'] / llama['tok_per_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"limit_bytes": limit, "pack_bytes": size, "llama": llama,
                                               "colibri": colibri, "colibri_sizing": sizing}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write an OLMoE-1B-7B-shaped pack with random weights")
    b.add_argument("out", type=Path)
    b.add_argument("--quant", default="q8_0", help="expert type: q8_0 or q4_g64")
    for key, value in OLMOE_SHAPE.items():
        b.add_argument(f"--{key.replace('_', '-')}", type=int, default=value)
    d = sub.add_parser("disk", help="O_DIRECT bandwidth of this pack's records")
    d.add_argument("pack", type=Path)
    d.add_argument("--queue-depth", type=int, default=16)
    r = sub.add_parser("run", help="decode with the expert cache at several sizes")
    r.add_argument("pack", type=Path)
    r.add_argument("--fractions", default="0.25,0.5,1.0", help="cache sizes as fractions of the expert bytes")
    r.add_argument("--policies", default="lru,lfru")
    r.add_argument("--prefetch", default="on", help="off, on (the engine's lookahead; on:N reads N guesses ahead a step) "
                   "or oracle (with --routing-trace: the next layer's true experts read ahead, the bound of any "
                   "next-layer predictor); comma-separated")
    r.add_argument("--alternate", type=int, default=0, metavar="TOKENS",
                   help="run the prefetch modes side by side, each with its own cache, in turns of TOKENS tokens "
                        "(the machine's drift then falls on all alike); ratios against the first mode")
    r.add_argument("--tokens", type=int, default=16)
    r.add_argument("--warmup", type=int, default=8)
    r.add_argument("--queue-depth", type=int, default=16)
    r.add_argument("--feed", default="random", choices=["random", "greedy"],
                   help="next input token: random (random routing, the default) or the greedy choice")
    r.add_argument("--routing-trace", type=Path, help="replay this bench/routing_traces.py trace's decode routing "
                   "(and, with prefetch on, its recorded --guesses) instead of the random router's")
    r.add_argument("--cgroup-limit", help="run inside a v1 memory cgroup with this limit (\"3G\")")
    r.add_argument("--threads", type=int, help="compute threads (default: one per CPU)")
    r.add_argument("--cache-bytes", type=int, help="one cache size in bytes instead of --fractions")
    r.add_argument("--hugepages", default="auto", help="the cache's hugepages setting (the daemon's default: auto); always off under "
                   "--cgroup-limit and in versus, since hugetlb pages are not charged to a v1 memory cgroup")
    r.add_argument("--json", help="also write the results here")
    v = sub.add_parser("versus", help="llama.cpp and Colibri decode under the same memory cgroup limit")
    v.add_argument("pack", type=Path)
    v.add_argument("gguf", type=Path, help="the same model as a GGUF for llama.cpp")
    v.add_argument("--limit-fraction", type=float, default=0.4, help="memory limit as a fraction of the pack")
    v.add_argument("--limit", help="memory limit (\"3G\"), instead of --limit-fraction")
    v.add_argument("--threads", type=int, default=2)
    v.add_argument("--tokens", type=int, default=32)
    v.add_argument("--warmup", type=int, default=8)
    v.add_argument("--llama-tokens", type=int, default=16)
    v.add_argument("--llama-args", default="", help="more llama-bench arguments, e.g. \"--repack 0\"")
    v.add_argument("--queue-depth", type=int, default=16)
    v.add_argument("--policy", default="lru")
    v.add_argument("--prefetch", default="off", choices=["on", "off"])
    v.add_argument("--json", help="also write the results here")
    pol = sub.add_parser("policies", help="cache policies on the trained default model's real routing")
    pol.add_argument("pack", type=Path, help="a pack of models/colibri-olmoe-stdlib")
    pol.add_argument("--fractions", default="0.25,0.5")
    pol.add_argument("--policies", default="lru,lfru")
    pol.add_argument("--prefetch", default="off,on")
    pol.add_argument("--tokens", type=int, default=4096)
    pol.add_argument("--document", type=int, default=512, help="tokens per sequence")
    pol.add_argument("--json", help="also write the results here")
    tr = sub.add_parser("trace-record", help="record a running daemon's routing stream to a trace file")
    tr.add_argument("out", type=Path)
    tr.add_argument("--socket", default=None, help="the daemon's socket (default: $COLIBRI_SOCKET or colibrictl's)")
    tr.add_argument("--seconds", type=float, help="stop after this long (default: at --steps, or Ctrl-C)")
    tr.add_argument("--steps", type=int, help="stop after this many step summaries")
    tp = sub.add_parser("trace-replay", help="replay a routing trace through the expert cache")
    tp.add_argument("pack", type=Path, help="the pack of the model the trace was recorded on")
    tp.add_argument("trace", type=Path, help="from trace-record, or `colibrictl ask --json --debug-routing` output")
    tp.add_argument("--fractions", default="0.25,0.5,1.0", help="cache sizes as fractions of the expert bytes")
    tp.add_argument("--policies", default="lru,lfru")
    tp.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if args.cmd == "trace-record":
        import os

        from colibrid.wire.client import DEFAULT_SOCKET_PATH

        socket_path = args.socket or os.environ.get("COLIBRI_SOCKET") or DEFAULT_SOCKET_PATH
        try:
            count = record_trace(socket_path, args.out, args.seconds, args.steps)
        except KeyboardInterrupt:
            count = None
        print(f"wrote {args.out}" + ("" if count is None else f": {count} step summaries"), file=sys.stderr)
        return 0
    if args.cmd == "trace-replay":
        return cmd_trace_replay(args)
    if args.cmd == "policies":
        return cmd_policies(args)
    if args.cmd == "build":
        shape = {k: getattr(args, k) for k in OLMOE_SHAPE}
        start = time.perf_counter()
        build_shaped_pack(args.out, quant=args.quant, **shape)
        print(f"wrote {args.out} in {time.perf_counter() - start:.0f} s")
        return 0
    if args.cmd == "disk":
        print(json.dumps(measure_disk(args.pack, queue_depth=args.queue_depth), indent=1))
        return 0
    if args.cmd == "versus":
        return cmd_versus(args)
    if args.cgroup_limit and args.alternate:
        raise SystemExit("--alternate keeps a cache for every prefetch mode at once, which the memory limit is not "
                         "sized for: under --cgroup-limit the modes run one after another")
    if args.cgroup_limit:
        inner = [sys.executable, str(Path(__file__).resolve()), "run", str(args.pack), "--fractions", args.fractions,
                 *(["--cache-bytes", str(args.cache_bytes)] if args.cache_bytes else []),
                 "--policies", args.policies, "--prefetch", args.prefetch, "--tokens", str(args.tokens),
                 "--warmup", str(args.warmup), "--queue-depth", str(args.queue_depth), "--feed", args.feed,
                 "--hugepages", "off"]  # hugetlb pages are not charged to a v1 memory cgroup
        if args.routing_trace:
            inner += ["--routing-trace", str(args.routing_trace)]
        if args.json:
            inner += ["--json", args.json]
        drop_from_page_cache(args.pack)
        return run_in_memory_cgroup(parse_size(args.cgroup_limit), inner)["code"]
    return cmd_run(args)


if __name__ == "__main__":
    sys.exit(main())
