"""Replayed routing (engine/routing_override.py, benches only): with an override installed,
every MoE layer runs exactly the trace's experts (the pack's i-th MoE layer the trace's layer
i mod L), the lookahead prefetches the trace's guesses instead of its router's, and without one
nothing changes."""

from __future__ import annotations

import numpy as np
import pytest

from colibrid.engine.engine import Engine
from colibrid.engine.experts.cache import CachedExpertSource
from colibrid.engine.routing_override import RoutingOverride
from colibrid.pack.reader import Pack

PROMPT = [5, 17, 42, 99, 3, 250, 7, 61]


@pytest.fixture(scope="module")
def engine(demo_pack):
    made = Engine(Pack.open(demo_pack))  # 4 MoE layers, 16 experts, top-4
    yield made
    made.close()


def _trace(rng: np.random.Generator, layers: int, rows: int, experts: int = 16, top_k: int = 4) -> np.ndarray:
    """(layers, rows, top_k) random distinct experts per row."""
    return np.stack([np.stack([rng.permutation(experts)[:top_k] for _ in range(rows)]) for _ in range(layers)])


def _captured_step(engine, ids: list[int]):
    capture = engine.model.routing_capture
    capture.enabled = True
    try:
        session = engine.new_session(max_context=64)
        logits = session.forward(ids)
        return logits, capture.step()
    finally:
        capture.enabled = False


def test_forced_routing_runs_the_traces_experts_layer_i_taking_trace_layer_i_mod_L(engine):
    forced = _trace(np.random.default_rng(0), layers=3, rows=len(PROMPT))  # 3 trace layers for 4 pack layers
    override = RoutingOverride.for_model(engine.model, trace_layers=3)
    override.set_step(forced)
    override.install(engine.model)
    try:
        _, routing = _captured_step(engine, PROMPT)
    finally:
        override.uninstall(engine.model)
    assert [override.trace_layer_of(layer) for layer in routing.layers] == [0, 1, 2, 0]
    np.testing.assert_array_equal(routing.experts[:3], forced)
    np.testing.assert_array_equal(routing.experts[3], forced[0])  # the wrap: pack layer 3 replays trace layer 0


def test_the_router_weights_stay_by_rank_and_forcing_its_own_choice_changes_no_bit(engine):
    plain, routing = _captured_step(engine, PROMPT)
    override = RoutingOverride.for_model(engine.model, trace_layers=4)
    override.set_step(routing.experts)  # the router's own choice, replayed
    override.install(engine.model)
    try:
        replayed, again = _captured_step(engine, PROMPT)
        shuffled = routing.experts[:, :, ::-1].copy()  # same experts, worst first: weights by rank move
        override.set_step(shuffled)
        moved, third = _captured_step(engine, PROMPT)
    finally:
        override.uninstall(engine.model)
    assert np.array_equal(replayed, plain)
    np.testing.assert_array_equal(again.weights, routing.weights)
    # Rank i keeps the router's i-th weight: the first layer's are the plain run's (later layers
    # route a residual stream the moved weights changed), and every row stays best first.
    np.testing.assert_array_equal(third.weights[0], routing.weights[0])
    assert (np.diff(third.weights, axis=2) <= 0).all()
    np.testing.assert_array_equal(third.experts, shuffled)
    assert not np.array_equal(moved, plain)
    after, _ = _captured_step(engine, PROMPT)  # uninstalled: the default path again, bit for bit
    assert np.array_equal(after, plain)


def test_the_cache_loads_exactly_the_forced_experts(demo_pack):
    pack = Pack.open(demo_pack)
    source = CachedExpertSource(pack, "64M", hugepages="off", lock_memory="off", prefetch=False)  # holds all
    engine = Engine(pack, experts=source)
    try:
        forced = _trace(np.random.default_rng(1), layers=2, rows=1)
        override = RoutingOverride.for_model(engine.model, trace_layers=2)
        override.install(engine.model)
        override.set_step(forced)
        engine.new_session(max_context=8).forward([7])
        for layer in range(4):
            resident = {e for e in range(16) if source.contains(layer, e)}
            assert resident == set(forced[layer % 2, 0].tolist()), layer
        assert source.stats()["total"]["misses"] == 4 * 4
    finally:
        source.close()


def _decode_with_guesses(demo_pack, guesses_of, steps: int = 6) -> dict:
    """Decodes ``steps`` tokens with forced routing and recorded guesses guesses_of(forced) (L-1, 1, G),
    through a cache too small to keep everything (so prefetches are real reads)."""
    pack = Pack.open(demo_pack)
    slot = -(-max(r.length for r in pack.manifest.expert_records) // 4096) * 4096
    source = CachedExpertSource(pack, 12 * slot, hugepages="off", lock_memory="off", prefetch=True)
    engine = Engine(pack, experts=source)
    rng = np.random.default_rng(2)
    try:
        override = RoutingOverride.for_model(engine.model, trace_layers=2)
        override.install(engine.model)
        session = engine.new_session(max_context=steps + 1)
        for token in range(steps):
            forced = _trace(rng, layers=2, rows=1)
            override.set_step(forced, guesses_of(forced))
            session.forward([token + 3])
        return source.stats()
    finally:
        source.close()


def test_recorded_guesses_reach_the_prefetch(demo_pack):
    def true_next(forced):  # trace layer 0 guesses trace layer 1's experts exactly, then two wrong ones
        wrong = np.setdiff1d(np.arange(16), forced[1, 0])[:2]
        return np.concatenate([forced[1:, :, :], wrong[None, None, :]], axis=2)  # (1, 1, 6)

    stats = _decode_with_guesses(demo_pack, true_next)
    by_layer = {row["layer"]: row for row in stats["layers"]}
    # Pack layers 0 and 2 (trace layer 0) predict layers 1 and 3 from the trace, and the engine takes the
    # first LOOKAHEAD_TOP = 4 guesses: all right. Layers 1 and 3 sit at the trace's wrap: no guesses.
    for layer in (1, 3):
        assert by_layer[layer]["prediction_precision"] == 1.0
        assert by_layer[layer]["prediction_recall"] == 1.0
    for layer in (0, 2):
        assert by_layer[layer]["prediction_precision"] is None  # nothing was predicted for them
    assert stats["total"]["prefetch_issued"] > 0

    def wrong_only(forced):
        return np.setdiff1d(np.arange(16), forced[1, 0])[None, None, :4]

    stats = _decode_with_guesses(demo_pack, wrong_only)
    assert stats["total"]["prediction_precision"] == 0.0


def test_bad_steps_are_refused(engine):
    override = RoutingOverride.for_model(engine.model, trace_layers=2)
    good = _trace(np.random.default_rng(3), layers=2, rows=1)
    with pytest.raises(ValueError, match="top-k"):
        override.set_step(good[:, :, :3])
    with pytest.raises(ValueError, match="expert ids"):
        override.set_step(np.where(good == good[0, 0, 0], 16, good))
    with pytest.raises(ValueError, match="distinct"):
        override.set_step(np.concatenate([good[:, :, :1]] * 4, axis=2))
    with pytest.raises(ValueError, match="guesses"):
        override.set_step(good, np.zeros((2, 1, 4), np.int64))  # guesses are for L-1 layers
    override.set_step(good)
    override.install(engine.model)
    try:
        with pytest.raises(ValueError, match="rows"):
            engine.new_session(max_context=8).forward([1, 2])
    finally:
        override.uninstall(engine.model)
