"""Replaying recorded routing in the AEPC bench: routing_traces.py --guesses records exactly
what the engine's lookahead would prefetch, read_decode_steps refuses traces that do not fit
the pack, and bench_aepc.py run --routing-trace decodes with the trace's experts and hands its
guesses to the prefetch."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.bench.bench_modules import load_bench_module

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_TRACE = ROOT / "bench" / "traces" / "stdlib64-greedy.jsonl"


traces = load_bench_module("routing_traces")
bench = load_bench_module("bench_aepc")


@pytest.mark.parametrize("predictor", ["router-on-moe-input", "router-on-residual"])
def test_recorded_guesses_are_what_the_engines_lookahead_prefetches(demo_pack, tmp_path, predictor):
    from colibrid.engine.engine import Engine
    from colibrid.engine.experts.cache import CachedExpertSource
    from colibrid.engine.forward.moe import LOOKAHEAD_TOP
    from colibrid.pack.reader import Pack

    out = tmp_path / "trace.jsonl"
    traces.record(demo_pack, out, sequences=1, prompt_tokens=8, generate=5, guesses=predictor, guesses_per_row=16)
    header, *steps = [json.loads(line) for line in out.read_text().splitlines()]
    assert header["guesses"]["predictor"] == predictor and header["guesses"]["per_row"] == 16
    assert "--guesses " + predictor in header["made_by"]
    for step in steps:  # (L - 1, rows, 16): a full ranking of the 16 experts per row
        guesses = np.asarray(step["guesses"])
        assert guesses.shape == (3, len(step["experts"][0]), 16)
        assert (np.sort(guesses, axis=2) == np.arange(16)).all()

    # The same greedy run with lookahead prefetch on: what it prefetches at each decode step is
    # the recorded guesses' first LOOKAHEAD_TOP.
    pack = Pack.open(demo_pack)
    source = CachedExpertSource(pack, "64M", hugepages="off", lock_memory="off", prefetch=True)
    prefetched: list[tuple[int, list[int]]] = []
    real_prefetch = source.prefetch
    source.prefetch = lambda layer, experts: (prefetched.append((layer, list(experts))), real_prefetch(layer, experts))[1]
    engine = Engine(pack, experts=source, lookahead_predictor=predictor)
    try:
        session = engine.new_session(max_context=16)
        (prompt,) = traces.validation_windows(engine.tokenizer, 1, 8)
        token = int(np.argmax(session.forward(prompt, all_logits=False)[-1]))
        assert len(steps) > 2  # the prompt step and decode steps
        for step in steps[1:]:
            prefetched.clear()
            token = int(np.argmax(session.forward([token], all_logits=False)[-1]))
            recorded = [(layer + 1, guesses[0][:LOOKAHEAD_TOP]) for layer, guesses in enumerate(step["guesses"])]
            assert prefetched == recorded
    finally:
        source.close()


def _write_trace(path: Path, steps: list[dict], top_k: int = 4, guesses: str | None = None) -> Path:
    header = {"trace": "colibri-routing", "version": 1, "moe_layers": [0, 1], "num_experts": 16, "top_k": top_k}
    if guesses:
        header["guesses"] = {"predictor": guesses, "per_row": 4}
    lines = [header] + [{"seq": 0, "phase": "prompt", "experts": [[[9, 10, 11, 12]] * 2] * 2}] + steps
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _local_steps(guesses_right: bool) -> list[dict]:
    """Decode steps of a 2-layer trace that only ever use experts 0-3 (layer 0) and 4-7 (layer 1),
    in changing orders, with layer 1's guesses either its true experts or four it never uses."""
    rng = np.random.default_rng(0)
    steps = []
    for _ in range(5):
        first, second = rng.permutation(4).tolist(), (4 + rng.permutation(4)).tolist()
        guess = second if guesses_right else [12, 13, 14, 15]
        steps.append({"seq": 0, "phase": "decode", "experts": [[first], [second]], "guesses": [[guess]]})
    return steps


def test_run_decodes_with_the_traces_experts_and_prefetches_its_guesses(demo_pack, tmp_path):
    from colibrid.pack.reader import Pack

    trace = _write_trace(tmp_path / "local.jsonl", _local_steps(guesses_right=True), guesses="router-on-moe-input")
    pack = Pack.open(demo_pack)
    replay = bench._routing_trace(trace, pack, ["on"])
    assert replay.experts.shape == (5, 2, 4) and replay.guesses.shape == (5, 1, 4) and replay.layers == 2
    expert_bytes = sum(r.length for r in pack.manifest.expert_records)
    # Half the 64 records fit: random routing would miss often, the trace's 16 experts never once warm.
    off = bench.decode_run(demo_pack, expert_bytes // 2, "lru", "off", tokens=6, warmup=3, queue_depth=4,
                           hugepages="off", replay=replay)
    assert off["hit_rate"] == 1.0 and off["records_read_per_token"] == 0.0
    assert off["prediction_precision"] is None  # prefetch off: nothing guessed
    # A cache too small for the trace's experts (4 layers x 4): reads, and the lookahead guesses
    # (pack layers 0 and 2, trace layer 0, guess layers 1 and 3) are always right.
    on = bench.decode_run(demo_pack, expert_bytes // 8, "lru", "on", tokens=6, warmup=3, queue_depth=4,
                          hugepages="off", replay=replay)
    assert on["records_read_per_token"] > 0
    assert on["prediction_precision"] == 1.0 and on["prediction_recall"] == 1.0
    trace = _write_trace(tmp_path / "wrong.jsonl", _local_steps(guesses_right=False), guesses="router-on-moe-input")
    miss = bench.decode_run(demo_pack, expert_bytes // 8, "lru", "on", tokens=6, warmup=3, queue_depth=4,
                            hugepages="off", replay=bench._routing_trace(trace, pack, ["on"]))
    assert miss["prediction_precision"] == 0.0 and miss["prefetch_issued"] > 0


def test_the_shipped_64_expert_trace_reads_as_decode_steps():
    replay = traces.read_decode_steps(SHIPPED_TRACE, num_experts=64, top_k=8)
    assert replay.layers == 8 and replay.experts.shape[1:] == (8, 8) and replay.guesses is None
    assert replay.experts.shape[0] > 100 and replay.predictor is None


def test_traces_that_do_not_fit_the_pack_are_refused(demo_pack, tmp_path):
    from colibrid.pack.reader import Pack

    good = _local_steps(guesses_right=True)
    with pytest.raises(SystemExit, match="per token"):  # the 64-expert model routes 8, the demo pack 4
        traces.read_decode_steps(SHIPPED_TRACE, num_experts=16, top_k=4)
    with pytest.raises(SystemExit, match="outside"):
        traces.read_decode_steps(SHIPPED_TRACE, num_experts=32, top_k=8)
    bad_id = [dict(good[0], experts=[[[0, 1, 2, 99]], [[4, 5, 6, 7]]])]
    with pytest.raises(SystemExit, match="outside"):
        traces.read_decode_steps(_write_trace(tmp_path / "a.jsonl", bad_id), 16, 4)
    twice = [dict(good[0], experts=[[[0, 1, 1, 2]], [[4, 5, 6, 7]]])]
    with pytest.raises(SystemExit, match="twice"):
        traces.read_decode_steps(_write_trace(tmp_path / "b.jsonl", twice), 16, 4)
    ragged = [good[0], dict(good[1], experts=[[[0, 1, 2, 3]]])]
    with pytest.raises(SystemExit, match="malformed"):
        traces.read_decode_steps(_write_trace(tmp_path / "c.jsonl", ragged), 16, 4)
    no_guesses = _write_trace(tmp_path / "d.jsonl", good)  # the header announces none
    assert traces.read_decode_steps(no_guesses, 16, 4).guesses is None
    with pytest.raises(SystemExit, match="--guesses"):  # prefetch on needs recorded guesses
        bench._routing_trace(no_guesses, Pack.open(demo_pack), ["off", "on"])
    assert bench._routing_trace(no_guesses, Pack.open(demo_pack), ["off", "oracle"]).guesses is None  # needs none
    (tmp_path / "e.jsonl").write_text("not json\n")
    with pytest.raises(SystemExit, match="not a bench/routing_traces.py trace"):
        traces.read_decode_steps(tmp_path / "e.jsonl", 16, 4)


def test_oracle_prefetch_reads_the_next_layers_true_experts(demo_pack, tmp_path):
    """prefetch "oracle" hands the lookahead the next layer's true experts, whatever the trace
    guessed (here: always wrong, then nothing at all), and reads all top-k of them ahead."""
    from colibrid.pack.reader import Pack

    pack = Pack.open(demo_pack)
    expert_bytes = sum(r.length for r in pack.manifest.expert_records)
    for steps, guesses in ((_local_steps(guesses_right=False), "router-on-moe-input"), (_local_steps(True), None)):
        trace = _write_trace(tmp_path / "t.jsonl", [{k: v for k, v in step.items() if guesses or k != "guesses"}
                                                    for step in steps], guesses=guesses)
        replay = bench._routing_trace(trace, pack, ["oracle"])
        oracle = bench.decode_run(demo_pack, expert_bytes // 8, "lru", "oracle", tokens=6, warmup=3, queue_depth=4,
                                  hugepages="off", replay=replay)
        assert oracle["prediction_precision"] == 1.0 and oracle["prediction_recall"] == 1.0
        assert oracle["prefetch_issued"] > 0
    with pytest.raises(ValueError, match="trace"):  # without a trace there is no next layer to know
        bench.DecodeRun(demo_pack, expert_bytes // 8, "lru", "oracle", 4, 8, hugepages="off")
    with pytest.raises(ValueError, match="prefetch must be"):
        bench.DecodeRun(demo_pack, expert_bytes // 8, "lru", "yes", 4, 8, hugepages="off")


def test_alternating_runs_decode_the_same_tokens_as_runs_alone(demo_pack, tmp_path):
    """Side by side, each configuration keeps its own cache and trace position: on demand it
    reads exactly what it reads alone, and no prefetch is left in flight after a turn."""
    from colibrid.pack.reader import Pack

    pack = Pack.open(demo_pack)
    expert_bytes = sum(r.length for r in pack.manifest.expert_records)
    trace = _write_trace(tmp_path / "local.jsonl", _local_steps(guesses_right=True), guesses="router-on-moe-input")
    replay = bench._routing_trace(trace, pack, ["off", "on"])
    alone = bench.decode_run(demo_pack, expert_bytes // 8, "lru", "off", tokens=7, warmup=3, queue_depth=4,
                             hugepages="off", replay=replay)
    runs = [bench.DecodeRun(demo_pack, expert_bytes // 8, "lru", mode, 4, 10, hugepages="off", replay=replay)
            for mode in ("off", "on", "oracle")]
    turns = []
    for run in runs:
        real_advance = run.advance
        run.advance = lambda n, run=run, real=real_advance: (turns.append((run.prefetch, n)), real(n))[1]
    try:
        rows = bench.alternate_runs(runs, tokens=7, warmup=3, turn=2)
        for run in runs:
            total = run.source.stats()["total"]
            assert total["loads"] + total["load_failures"] == total["misses"] + total["prefetch_issued"]
    finally:
        for run in runs:
            run.close()
    assert [row["prefetch"] for row in rows] == ["off", "on", "oracle"]
    assert all(row["tokens"] == 7 for row in rows)
    assert sorted(n for mode, n in turns if mode == "on") == [1, 2, 2, 2]  # turns of 2, the last what is left
    assert len({tuple(mode for mode, _ in turns[i:i + 3]) for i in range(0, 12, 3)}) > 1  # the order changes
    assert rows[0]["records_read_per_token"] == alone["records_read_per_token"] > 0
    assert rows[0]["hit_rate"] == alone["hit_rate"]
    assert rows[2]["prediction_precision"] == 1.0


def test_prefetch_modes_parse_and_on_n_reads_n_guesses_ahead(demo_pack, tmp_path):
    from colibrid.engine.forward.moe import LOOKAHEAD_TOP
    from colibrid.pack.reader import Pack

    assert bench.prefetch_mode("off") == ("off", None) and bench.prefetch_mode("oracle") == ("oracle", None)
    assert bench.prefetch_mode("on") == ("on", None) and bench.prefetch_mode("on:6") == ("on", 6)
    for bad in ("on:0", "on:x", "oracle:2", "off:1", "maybe"):
        with pytest.raises(ValueError, match="prefetch must be"):
            bench.prefetch_mode(bad)
    pack = Pack.open(demo_pack)
    expert_bytes = sum(r.length for r in pack.manifest.expert_records)
    trace = _write_trace(tmp_path / "local.jsonl", _local_steps(guesses_right=True), guesses="router-on-moe-input")
    replay = bench._routing_trace(trace, pack, ["on:2"])
    for mode, top in (("on", LOOKAHEAD_TOP), ("on:2", 2), ("oracle", 4)):  # the demo pack routes top-4
        run = bench.DecodeRun(demo_pack, expert_bytes // 8, "lru", mode, 4, 8, hugepages="off", replay=replay)
        try:
            assert {layer.moe.lookahead_top for layer in run.engine.model.layers if layer.moe} == {top}
        finally:
            run.close()


def test_run_refuses_an_oracle_without_a_trace_and_unknown_modes(demo_pack):
    with pytest.raises(SystemExit, match="--routing-trace"):
        bench.main(["run", str(demo_pack), "--prefetch", "off,oracle"])
    with pytest.raises(SystemExit, match="--prefetch takes"):
        bench.main(["run", str(demo_pack), "--prefetch", "sometimes"])
    with pytest.raises(SystemExit, match="one after another"):  # a cache per mode would not fit the limit
        bench.main(["run", str(demo_pack), "--prefetch", "off,on", "--alternate", "8", "--cgroup-limit", "1G"])
