"""bench/predictor_study.py: the metrics count what they say, the probe learns from the first
half of the windows only, and every predictor reads the states the engine routed on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.bench.bench_modules import load_bench_module

ROOT = Path(__file__).resolve().parents[2]


study_mod = load_bench_module("predictor_study")


def test_budgets_are_top_k_times_the_factors_rounded_half_up():
    assert study_mod.budgets(2) == [2, 3, 4]  # 2.5 -> 3, the same as 1.5 x 2
    assert study_mod.budgets(8) == [8, 10, 12, 16]
    assert study_mod.budgets(4) == [4, 5, 6, 8]
    assert study_mod.budgets(8, (0.5, 1.0, 2.0), num_experts=12) == [4, 8, 12]  # never more than there are


def test_hits_guesses_and_actual_are_counted_per_row():
    guesses = np.array([[1, 2, -1], [3, 4, 5], [-1, -1, -1]])
    actual = np.array([[2, 7], [5, 3], [1, 2]])
    # row 0: 2 of {1, 2} used; row 1: 3 and 5 of {3, 4, 5}; row 2: no guess
    assert study_mod.count_hits(guesses, actual) == (3, 5, 6)


def test_a_join_keeps_the_first_guesses_and_drops_repeats():
    joined = study_mod.join_guesses(np.array([[1, 2], [3, 4]]), np.array([[2, 9], [5, 6]]))
    np.testing.assert_array_equal(joined, [[1, 2, -1, 9], [3, 4, 5, 6]])


def test_previous_rows_stay_within_the_window():
    rows = np.arange(10.0).reshape(5, 2)
    np.testing.assert_array_equal(study_mod.previous_rows(rows, np.array([0, 0, 0, 1, 1])),
                                  [[0, 0], [0, 1], [2, 3], [0, 0], [6, 7]])


def test_recent_experts_look_back_within_the_window_only():
    experts = np.array([[1, 2], [2, 3], [4, 1], [7, 8], [8, 9]])
    sequence = np.array([0, 0, 0, 1, 1])
    np.testing.assert_array_equal(study_mod.recent_experts(experts, sequence, 3),
                                  [[-1, -1, -1], [1, 2, -1], [2, 3, 1], [-1, -1, -1], [7, 8, -1]])


def _synthetic_study(actual: list[np.ndarray], guesses: dict, top_k: int, scored: np.ndarray, budgets: list[int]):
    previous = [np.full_like(a, -1) for a in actual]
    return study_mod.Study(top_k, budgets, list(range(len(actual) + 1)), guesses, previous, actual, {},
                           ~scored, scored)


def test_a_predictor_that_knows_the_answer_has_recall_one_and_precision_k_over_n():
    rng = np.random.default_rng(0)
    rows, experts, top_k = 40, 16, 2
    actual = [np.stack([rng.choice(experts, top_k, replace=False) for _ in range(rows)]) for _ in range(3)]
    others = [np.stack([[e for e in range(experts) if e not in row] for row in a]) for a in actual]  # (rows, 14)
    oracle = [np.concatenate([a, o[:, :2]], axis=1) for a, o in zip(actual, others)]  # the true experts first
    blind = [o[:, 2:6] for o in others]  # never a used one
    scored = np.arange(rows) >= rows // 2
    study = _synthetic_study(actual, {"router-on-residual": oracle, "router-on-moe-input": blind}, top_k, scored,
                             [2, 3, 4])
    rows_out = {(r["predictor"], r["n"]): r for r in study_mod.scores(study, per_layer=True)}
    for n in (2, 3, 4):
        r = rows_out["router-on-residual", n]
        assert r["recall"] == 1.0 and r["precision"] == pytest.approx(top_k / n) and r["overfetch"] == pytest.approx(n / top_k)
        assert all(item["actual"] == top_k * (rows - rows // 2) for item in r["layers"])  # the scored rows only
        assert rows_out["router-on-moe-input", n]["recall"] == 0.0 and rows_out["router-on-moe-input", n]["layers"]
    joined = rows_out["router-on-residual+previous-token", 2]  # no probe: the residual one, joined
    assert joined["recall"] == 1.0 and joined["overfetch"] == 1.0  # no previous token known: nothing added


def test_the_probe_learns_a_linear_correction_and_picks_its_ridge_on_held_out_windows():
    rng = np.random.default_rng(1)
    rows, dim, experts, top_k = 600, 12, 8, 2
    features = rng.normal(size=(rows, dim))
    base = rng.normal(size=(rows, experts))
    true_weight = rng.normal(size=(dim, experts))
    target = base + features @ true_weight
    actual = study_mod.rank(target, top_k)
    sequence, decode = np.repeat(np.arange(4), rows // 4), np.ones(rows, bool)
    probe = study_mod.fit_probe(features, base, target, actual, sequence, decode, top_k)
    np.testing.assert_allclose(probe.weight, true_weight, atol=0.05)  # weak ridge: the exact map
    assert probe.alpha <= 0.01
    noise = rng.normal(size=(rows, experts)) * 100  # the correction is noise: keep the base ranking
    probe = study_mod.fit_probe(features, base, base + noise, study_mod.rank(base, top_k), sequence, decode, top_k)
    assert probe.alpha == max(study_mod.RIDGE_ALPHAS)


@pytest.fixture(scope="module")
def recorded(demo_pack):
    from colibrid.engine.engine import Engine
    from colibrid.pack.reader import Pack

    engine = Engine(Pack.open(demo_pack))
    try:
        prompts = [list(range(10 + 7 * i, 18 + 7 * i)) for i in range(4)]
        rec = study_mod.record(engine, prompts, generate=6, progress=False)
        yield engine, rec
    finally:
        engine.close()


def test_the_recording_holds_every_row_and_the_predictors_read_what_the_engine_routed_on(recorded):
    engine, rec = recorded
    config, model = engine.config, engine.model
    n_layers, top_k = len(config.moe_layer_ids), config.num_experts_per_tok
    assert rec.windows == 4 and rec.experts.shape[:2] == rec.residuals.shape[:2] == (n_layers, rec.sequence.shape[0])
    assert not engine.model.routing_capture.enabled and not engine.model.routing_capture.keep_hidden
    assert rec.fit_rows().tolist() == (rec.sequence < 2).tolist()
    assert rec.eval_rows().tolist() == ((rec.sequence >= 2) & rec.decode).tolist()
    for i in range(1, n_layers):
        nxt = study_mod.NextLayer(model, config.moe_layer_ids[i], 2 * top_k)
        ranked = nxt.ranking(rec.moe_inputs[i])  # layer i's router on its own input: the routed experts first
        np.testing.assert_array_equal(ranked[:, :top_k], rec.experts[i])
        by_logits = study_mod.rank(nxt.logits(rec.moe_inputs[i]), top_k)  # the probe's target ranks the same
        np.testing.assert_array_equal(np.sort(by_logits, axis=1), np.sort(rec.experts[i], axis=1))


def test_the_probe_fits_on_the_first_half_and_is_scored_on_the_second(recorded):
    engine, rec = recorded
    top_k = engine.config.num_experts_per_tok
    budgets = study_mod.budgets(top_k)
    study = study_mod.predict(engine.model, rec, top_k, budgets)
    assert set(study.guesses) == {"router-on-moe-input", "router-on-residual", "probe", "probe-context",
                                  "previous-token"}
    second = ~rec.fit_rows()
    changed = study_mod.Recording(rec.experts, rec.moe_inputs.copy(), rec.residuals.copy(), rec.sequence, rec.decode)
    changed.residuals[:, second] += 1.0  # the second half's states: the probe must not move
    changed.moe_inputs[:, second] *= -1.0
    again = study_mod.predict(engine.model, changed, top_k, budgets)
    for name in ("probe", "probe-context"):
        for a, b in zip(study.probes[name], again.probes[name], strict=True):
            np.testing.assert_array_equal(a.weight, b.weight)
            assert a.alpha == b.alpha
    changed.residuals[:, ~second] += 1.0  # the first half's: it must
    moved = study_mod.predict(engine.model, changed, top_k, budgets)
    for name in ("probe", "probe-context"):
        assert any(not np.array_equal(a.weight, b.weight) for a, b in zip(study.probes[name], moved.probes[name]))
    rows = study_mod.scores(study)
    assert {r["n"] for r in rows} == set(budgets)
    assert all(0.0 <= r["recall"] <= 1.0 and 0.0 <= r["precision"] <= 1.0 for r in rows)
    fixed = [r for r in rows if not r["predictor"].endswith("+previous-token") and r["predictor"] != "previous-token"]
    assert all(r["overfetch"] == pytest.approx(r["n"] / top_k) for r in fixed)


@pytest.mark.parametrize("rows", [5, 40])
def test_ridge_is_the_same_with_fewer_rows_than_features_or_more(rows):
    rng = np.random.default_rng(rows)
    x, y = rng.normal(size=(rows, 20)), rng.normal(size=(rows, 3))
    weight, bias = study_mod.fit_ridge(x, y, 0.1)
    xc, yc = x - x.mean(axis=0), y - y.mean(axis=0)  # the textbook normal equations
    penalty = 0.1 * (xc ** 2).sum() / 20
    expected = np.linalg.solve(xc.T @ xc + penalty * np.eye(20), xc.T @ yc)
    np.testing.assert_allclose(weight, expected, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(bias, y.mean(axis=0) - x.mean(axis=0) @ expected, rtol=1e-8, atol=1e-10)


def test_the_markdown_table_has_a_cell_per_predictor_and_guess_count():
    assert "| n = 10 (1.25×) |" in study_mod.markdown_table(
        [{"predictor": "a", "n": 10, "recall": 1.0, "precision": 0.8, "overfetch": 1.25}], top_k=8)
    rows = [{"predictor": "a", "n": 2, "recall": 0.5, "precision": 0.5, "overfetch": 1.0},
            {"predictor": "a", "n": 4, "recall": 0.75, "precision": 0.375, "overfetch": 2.0},
            {"predictor": "a+b", "n": 2, "recall": 0.9, "precision": 0.6, "overfetch": 1.5},
            {"predictor": "a+b", "n": 4, "recall": 1.0, "precision": 0.4, "overfetch": 2.5}]
    assert study_mod.markdown_table(rows, top_k=2).splitlines() == [
        "| predictor | n = 2 (1×) | n = 4 (2×) |",
        "|---|---|---|",
        "| a | 50.0% / 50.0% | 75.0% / 37.5% |",
        "| a+b | 90.0% / 60.0% (1.50×) | 100.0% / 40.0% (2.50×) |"]
