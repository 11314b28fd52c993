"""bench/bench_serving.py: what it computes from the timings and the daemon's status, and one
small run of its load generator against a real colibrid on the demo pack (no llama.cpp)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import bench_serving  # noqa: E402
from bench_serving import RequestTiming, StepBytes, batch_during, summarize  # noqa: E402


def test_aggregate_rates_and_latencies_from_two_overlapping_requests():
    timings = [RequestTiming(0, 0.0, [1.0, 2.0, 3.0], "length", 16),
               RequestTiming(1, 0.5, [1.5, 2.5, 3.5], "length", 16)]
    r = summarize(timings, expected_tokens=3)
    assert (r["ok"], r["short"], r["tokens"]) == (2, 0, 6)
    assert r["aggregate_tok_s"] == pytest.approx(6 / 3.5)  # every token, from the first request sent
    assert r["aggregate_decode_tok_s"] == pytest.approx(4 / 2.5)  # tokens after each first, first to last token
    assert r["steady_decode_tok_s"] == pytest.approx(3 / 1.5)  # while both decode: 2.0, 2.5, 3.0 in (1.5, 3.0]
    assert (r["ttft_ms_p50"], r["itl_ms_p50"], r["itl_ms_p99"]) == pytest.approx((1000.0, 1000.0, 1000.0))


def test_the_steady_rate_leaves_out_a_late_prompt_s_prefill():
    """The first request decodes alone for a while (a late prompt prefilling): the aggregate
    counts that span, the steady rate only the steps where both decode."""
    timings = [RequestTiming(0, 0.0, [1.0, 5.0, 6.0, 7.0], "length", 16),
               RequestTiming(1, 0.0, [5.0, 6.0, 7.0, 8.0], "length", 16)]
    r = summarize(timings, expected_tokens=4)
    assert r["aggregate_decode_tok_s"] == pytest.approx(6 / 7.0)
    assert r["steady_decode_tok_s"] == pytest.approx(4 / 2.0)  # 6.0 and 7.0 of each, over (5.0, 7.0]


def test_failed_and_short_requests_are_counted_not_averaged():
    timings = [RequestTiming(0, 0.0, [1.0, 2.0], "length"), RequestTiming(1, 0.0, [1.0], "eos"),
               RequestTiming(2, 0.0, error="[busy] the queue is full")]
    r = summarize(timings, expected_tokens=2)
    assert (r["requests"], r["ok"], r["short"], r["errors"]) == (3, 2, 1, ["[busy] the queue is full"])
    assert r["finish_reasons"] == ["eos", "length"]


def test_the_run_s_batch_means_are_the_difference_of_the_since_start_sums():
    before = {"batch": {"steps": 10, "distinct_experts_per_layer_step": 8.0, "sequence_experts_per_layer_step": 8.0}}
    after = {"batch": {"steps": 30, "distinct_experts_per_layer_step": 20.0, "sequence_experts_per_layer_step": 36.0,
                       "max_batch": 8, "size": 0, "prefill_chunk": 64}}
    b = batch_during(before, after)
    assert b["steps"] == 20 and b["max_batch"] == 8 and b["prefill_chunk"] == 64
    assert b["distinct_experts_per_layer_step"] == pytest.approx((20 * 30 - 8 * 10) / 20)
    assert b["sequence_experts_per_layer_step"] == pytest.approx((36 * 30 - 8 * 10) / 20)
    assert batch_during({}, {"cache": {}}) == {"max_batch": None, "prefill_chunk": None, "steps": None,
                                               "distinct_experts_per_layer_step": None,
                                               "sequence_experts_per_layer_step": None}


def test_the_bound_counts_dense_bytes_once_per_step_and_each_distinct_expert_once():
    step = StepBytes(dense_bytes=100, embedding_row_bytes=0, expert_bytes=10, moe_layers=2, num_experts=4, top_k=2,
                     vocab_size=1000)
    assert step.step(1, 2) == 100 + 2 * 2 * 10
    # two sequences sharing one of their two experts in each layer: 3 distinct
    assert step.tokens_per_byte_bound(2, 3) == pytest.approx(2 * 140 / (100 + 2 * 3 * 10))
    assert step.tokens_per_byte_bound(1, 2) == pytest.approx(1.0)
    assert step.random_routing_distinct(1) == pytest.approx(2) and step.random_routing_distinct(2) == pytest.approx(3)


def test_the_disk_bound_under_a_limit_is_the_rest_of_a_step_s_experts_after_every_slot_hits(capsys):
    def row(clients, distinct, cache_slots, misses, tokens):
        return {"clients": clients, "colibri": {"batch": {"distinct_experts_per_layer_step": distinct},
                                                "cache_bytes": cache_slots * 4096 + 100, "tokens": tokens,
                                                "cache": {"misses": misses}}}

    rows = [row(1, 8.0, 30, 120, 40), row(8, 20.0, 25, 800, 80)]
    bench_serving.read_bound(rows, slot_bytes=4096, moe_layers=2)
    one, eight = rows[0]["read_bound"], rows[1]["read_bound"]
    assert (one["slots"], one["least_per_token"], one["read_per_token"], one["bound_vs_single"]) == (30, 0.0, 3.0, None)
    # a step of 8 needs 20 x 2 records; 25 slots can hold 25 of them: 15 reads a step at least
    assert (eight["needed_per_step"], eight["least_per_token"], eight["read_per_token"]) == (40.0, 15 / 8, 10.0)
    assert eight["bound_vs_single"] == pytest.approx(3.0 / (15 / 8))
    assert "bound vs 1" in capsys.readouterr().out


def test_a_small_run_against_colibrid(demo_pack, tmp_path):
    out = tmp_path / "serving.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "bench_serving.py"), "--pack", str(demo_pack),
                           "--skip-llama", "--skip-roofline", "--memory", "cached", "--clients", "2", "--tokens", "4",
                           "--prompt-tokens", "16", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "targets at 8 clients" in proc.stdout and "Colibri kernels" in proc.stdout
    (result,) = json.loads(out.read_text())["results"]
    (row,) = result["rows"]
    colibri = row["colibri"]
    assert (row["clients"], colibri["ok"], colibri["errors"]) == (2, 2, [])
    # ignore_eos: each request ran its full length
    assert (colibri["short"], colibri["finish_reasons"]) == (0, ["length"])
    for timing in colibri["timings"]:
        assert len(timing["token_times_s"]) == 4 and timing["sent_s"] < timing["token_times_s"][0]
        assert timing["token_times_s"] == sorted(timing["token_times_s"])
    assert 14 <= colibri["prompt_tokens_mean"] <= 17  # as asked, or up to two fewer; a BOS if the model adds one
    assert colibri["cache"]["bytes_read"] == 0  # the warm-up read every expert: fully cached
    # the KV budget is what the two requests reserve (prompt + 1 + tokens each), so both join at once
    from colibrid.pack.reader import Pack

    c = Pack.open(demo_pack).manifest.model
    assert colibri["kv_cache"]["budget_bytes"] == 2 * c.num_layers * (16 + 1 + 4) * 2 * c.num_kv_heads * c.head_dim * 4
    assert colibri["kv_cache"]["type"] == "f32"
    assert set(colibri["batch"]) >= {"distinct_experts_per_layer_step", "sequence_experts_per_layer_step"}
    assert row["bound"]["random_routing_bound"] > 1


def test_prompts_differ_per_client_and_hold_about_the_tokens_asked(demo_pack):
    from colibrid.engine.text.tokenizer import Tokenizer

    texts = bench_serving.colibri_prompts(demo_pack, 3, 32, seed=1)
    assert len(set(texts)) == 3
    tokenizer = Tokenizer.from_dir(demo_pack)
    assert all(28 <= len(tokenizer.encode(t, add_special_tokens=False)) <= 32 for t in texts)
    assert texts == bench_serving.colibri_prompts(demo_pack, 3, 32, seed=1)


def test_the_ratios_over_rounds_are_their_median_and_range():
    rounds = [{"vs_own_single": 2.0, "vs_llama_server": None, "steady_vs_own_single": 2.4},
              {"vs_own_single": 1.6, "vs_llama_server": None, "steady_vs_own_single": 2.1},
              {"vs_own_single": 2.3, "vs_llama_server": None, "steady_vs_own_single": None}]
    medians = bench_serving.target_medians(rounds)
    assert medians["vs_own_single"] == {"median": 2.0, "min": 1.6, "max": 2.3, "rounds": 3}
    assert medians["steady_vs_own_single"] == {"median": pytest.approx(2.25), "min": 2.1, "max": 2.4, "rounds": 2}
    assert medians["vs_llama_server"] is None  # no round had llama-server
