"""The model's routing capture (engine/routing_capture.py): off unless enabled, and when on,
each row's recorded choice is that row's own (the same as the sequence alone), counted right;
hidden states are kept only when asked, and keeping them changes no number."""

from __future__ import annotations

import numpy as np
import pytest

from colibrid.engine.engine import Engine
from colibrid.engine.forward.ops import linear, rms_norm
from colibrid.engine.forward.model import StepInput
from colibrid.pack.reader import Pack


@pytest.fixture(scope="module")
def engine(demo_pack):
    engine = Engine(Pack.open(demo_pack))
    yield engine
    engine.close()


def _step(engine, prompts: list[list[int]]):
    states = [engine.model.new_state(64) for _ in prompts]
    engine.model.forward_batch([StepInput(state, np.asarray(ids), "last") for state, ids in zip(states, prompts)])
    return engine.model.routing_capture.step()


def test_nothing_is_recorded_unless_enabled(engine):
    capture = engine.model.routing_capture
    assert not capture.enabled
    assert _step(engine, [[5, 6, 7]]) is None


def test_each_rows_choice_is_its_own_and_counted(engine):
    capture = engine.model.routing_capture
    capture.enabled = True
    try:
        together = _step(engine, [[5, 6, 7], [100, 200], [9]])
        alone = _step(engine, [[100, 200]])
    finally:
        capture.enabled = False
    config = engine.config
    assert together.layers == alone.layers == config.moe_layer_ids
    assert together.experts.shape == (len(config.moe_layer_ids), 6, config.num_experts_per_tok)
    assert together.bounds.tolist() == [0, 3, 5, 6]
    assert together.last_row_of(1) == 4
    np.testing.assert_array_equal(together.experts[:, 3:5], alone.experts)
    np.testing.assert_allclose(together.weights[:, 3:5], alone.weights, rtol=1e-6)
    expected = np.zeros((len(together.layers), config.num_experts), np.int64)
    for layer in range(len(together.layers)):  # the plain way: row by row
        for row in together.experts[layer]:
            for expert in row:
                expected[layer, expert] += 1
    np.testing.assert_array_equal(together.counts(), expected)
    experts, weights = together.row(together.last_row_of(2))
    assert experts.shape == weights.shape == (len(together.layers), config.num_experts_per_tok)


def _greedy(engine, ids: list[int], steps: int) -> tuple[list[np.ndarray], list]:
    """Logits and captured routing of a prompt step, then ``steps`` greedy decode steps."""
    session = engine.new_session(max_context=len(ids) + steps + 1)
    logits, routings = [session.forward(ids, all_logits=False)], [engine.model.routing_capture.step()]
    for _ in range(steps):
        logits.append(session.forward([int(np.argmax(logits[-1][-1]))], all_logits=False))
        routings.append(engine.model.routing_capture.step())
    return logits, routings


def test_hidden_states_are_kept_only_when_asked_and_change_no_logits(engine, monkeypatch):
    capture = engine.model.routing_capture
    calls = []
    monkeypatch.setattr(capture, "record_hidden", lambda *args: calls.append(args))
    plain, _ = _greedy(engine, [5, 6, 7], 3)  # capture off
    capture.enabled = True
    try:
        routed, routings = _greedy(engine, [5, 6, 7], 3)  # on, without hidden states
    finally:
        capture.enabled = False
    assert calls == []  # off, the hook never runs: no copy, no cost beyond an attribute test
    assert all(r.moe_inputs is None and r.residuals is None for r in routings)
    monkeypatch.undo()
    capture.enabled = capture.keep_hidden = True
    try:
        kept, routings = _greedy(engine, [5, 6, 7], 3)
    finally:
        capture.enabled = capture.keep_hidden = False
    for a, b, c in zip(plain, routed, kept):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    config, model = engine.config, engine.model
    n_layers = len(config.moe_layer_ids)
    assert [r.moe_inputs.shape for r in routings] == [(n_layers, 3, config.hidden_size)] + [(n_layers, 1, config.hidden_size)] * 3
    for logits, r in zip(kept, routings):
        # the residual kept after the last layer is what the output head reads
        head = linear(rms_norm(r.residuals[-1][-1:], model.final_norm, config.rms_norm_eps), model.lm_head)
        np.testing.assert_allclose(head, logits, rtol=1e-5, atol=1e-5)
        for i, layer in enumerate(config.moe_layer_ids):  # each layer's input is what its router chose on
            np.testing.assert_array_equal(model.layers[layer].moe.router(r.moe_inputs[i]).experts, r.experts[i])
