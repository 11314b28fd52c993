"""bench/history_ceiling.py: next-token recall of history rankers, counted right."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.bench.bench_modules import load_bench_module


def _write_trace(path: Path, decode_experts: list[list[list[int]]], num_experts: int) -> None:
    """decode_experts: per token, per layer, the top-k experts; one prompt step first (dropped)."""
    layers = len(decode_experts[0])
    lines = [{"trace": "colibri-routing", "version": 1, "moe_layers": list(range(layers)), "num_experts": num_experts,
              "top_k": len(decode_experts[0][0])},
             {"seq": 0, "phase": "prompt", "experts": [[[0, 1], [2, 3]] for _ in range(layers)]}]
    lines += [{"seq": 0, "phase": "decode", "experts": [[row] for row in token]} for token in decode_experts]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")


def test_recall_counts_the_actual_experts_among_the_best_n():
    hc = load_bench_module("history_ceiling")
    scores = np.array([[[0.9, 0.1, 0.5, 0.0]]])  # one token, one layer: ranking 0, 2, 1, 3
    actual = np.array([[[False, True, True, False]]])
    assert hc.recall_at(scores, actual, 1) == 0.0
    assert hc.recall_at(scores, actual, 2) == 0.5
    assert hc.recall_at(scores, actual, 3) == 1.0


def test_a_routing_that_never_changes_is_fully_predicted_and_prompt_steps_are_dropped(tmp_path, capsys):
    hc = load_bench_module("history_ceiling")
    trace = tmp_path / "steady.jsonl"
    _write_trace(trace, [[[4, 5], [6, 7]]] * 40, num_experts=8)
    used = hc.decode_usage(hc.read_trace(trace))
    assert used.shape == (40, 2, 8) and used.sum() == 40 * 4
    assert hc.main([str(trace), "--budgets", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert {row[0] for row in rows} == {f"ema:{h}" for h in hc.HALF_LIVES} | {"linear"}
    assert all(row[1] == "100.0%" for row in rows)


def test_alternating_routing_is_caught_by_the_fitted_ranker_not_by_a_long_decayed_count(tmp_path, capsys):
    """Experts {0,1} and {2,3} take turns: "used at t" predicts "not used at t+1", which only the
    fitted ranker can learn; a long half-life ranks all four alike (ties: lowest id first)."""
    hc = load_bench_module("history_ceiling")
    trace = tmp_path / "alternating.jsonl"
    _write_trace(trace, [[[0, 1]] if t % 2 == 0 else [[2, 3]] for t in range(200)], num_experts=4)
    hc.main([str(trace), "--budgets", "1"])
    recall = {row[0]: row[1] for row in (line.split() for line in capsys.readouterr().out.splitlines()[2:])}
    assert recall["linear"] == "100.0%"
    assert recall["ema:1"] == "0.0%"  # the last token's experts rank first: always the wrong pair
