"""The model's routing capture (engine/routing_capture.py): off unless enabled, and when on,
each row's recorded choice is that row's own (the same as the sequence alone), counted right."""

from __future__ import annotations

import numpy as np
import pytest

from colibrid.engine.engine import Engine
from colibrid.engine.model import StepInput
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
