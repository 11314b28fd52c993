"""An expert record found damaged is marked (colibrid/pack/damage.py): the requests that need
it fail with `pack_damaged` naming it, without reading it again, and the requests of the same
batch that do not need it get exactly the tokens they get alone."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from colibrid.engine.batch import SequenceFailed, StepFailed
from colibrid.engine.generate import GenerationDone, GenerationEvent
from colibrid.engine.sampling import SamplingParams
from tests.pack.conftest import flip_byte


def _run(engine, requests):
    """Runs ``requests`` together in one batch; each one's outcomes, or the StepFailed that ended it."""
    batch = engine.new_batch(8, 64, 1 << 34)
    outcomes = [[] for _ in requests]
    for i, (prompt, params) in enumerate(requests):
        batch.admit(i, *engine.start_generation(prompt, params))
    while len(batch):
        try:
            for sequence, produced in batch.step():
                outcomes[sequence.key].extend(produced)
        except StepFailed as failure:
            for sequence in failure.sequences:
                outcomes[sequence.key].append(failure)
    return outcomes


def _recording(source):
    """Records every (layer, expert) the model asks ``source`` for."""
    asked = []
    acquire = source.acquire

    def recording_acquire(layer, experts):
        asked.extend((layer, int(e)) for e in experts)
        return acquire(layer, experts)

    source.acquire = recording_acquire
    return asked


def _tokens(outcomes):
    return [o.token_id for o in outcomes if isinstance(o, GenerationEvent)]


@pytest.fixture
def engine(demo_pack, tmp_path):
    from colibrid.engine.engine import Engine
    from colibrid.pack.reader import Pack

    return Engine(Pack.open(shutil.copytree(demo_pack, tmp_path / "demo.pack")))


def test_only_the_requests_needing_a_damaged_record_fail_and_it_is_not_read_again(engine):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    rng = np.random.default_rng(3)
    asked = _recording(engine.experts)
    long_prompt = rng.integers(3, engine.config.vocab_size, 40).tolist()
    _run(engine, [(long_prompt, params)])
    used_by_long = set(asked)
    for _ in range(20):  # a short request that leaves some expert the long one uses alone
        asked.clear()
        short_prompt = rng.integers(3, engine.config.vocab_size, 2).tolist()
        short_alone = _run(engine, [(short_prompt, params)])[0]
        spared = sorted(used_by_long - set(asked))
        if spared:
            break
    layer, expert = spared[0]
    record = engine.pack.expert_record(layer, expert)
    flip_byte(engine.pack.experts_path, record.offset + 123)

    asked.clear()
    long_outcomes, short_outcomes = _run(engine, [(long_prompt, params), (short_prompt, params)])
    failed = long_outcomes[-1]
    assert isinstance(failed, SequenceFailed) and failed.code == "pack_damaged"
    assert (failed.damage["layer"], failed.damage["expert"], failed.damage["offset"]) == (layer, expert, record.offset)
    assert failed.damage["found_by"] == "load"
    assert f"pack damaged: expert {expert} of layer {layer} at offset {record.offset}" in failed.message
    assert "colibri-verify" in failed.message
    assert isinstance(short_outcomes[-1], GenerationDone) and _tokens(short_outcomes) == _tokens(short_alone)
    assert asked.count((layer, expert)) == 1  # read once, found damaged, marked

    asked.clear()
    (again,) = _run(engine, [(long_prompt, params)])  # alone: the whole step fails, at once
    assert isinstance(again[-1], StepFailed) and "pack damaged" in str(again[-1].__cause__)
    assert (layer, expert) not in asked  # not read again
    assert [(r.layer, r.expert) for r in engine.pack.damage.records()] == [(layer, expert)]


def test_a_layer_started_over_without_a_damaged_record_records_its_routing_once(engine):
    """The routing capture (colibrictl top, debug_routing) and the damage watch compose: a MoE
    layer whose load finds a record damaged starts over without it, and the capture still gets
    that layer's routing once, the router's choice (damaged expert included), for every row."""
    from collections import Counter

    from colibrid.engine.forward.model import StepInput
    from colibrid.engine.forward.moe import StepDamaged

    model, capture = engine.model, engine.model.routing_capture
    prompts = [[5, 6, 7, 8, 9], [300, 301]]

    def step():
        states = [model.new_state(64) for _ in prompts]
        return model.forward_batch([StepInput(state, np.asarray(ids), "last") for state, ids in zip(states, prompts)])

    capture.enabled = True
    try:
        step()
        clean = capture.step()
        # An expert only the first sequence's rows chose, in some MoE layer.
        rows_of_second = slice(len(prompts[0]), None)
        layer_index, expert = next(
            (i, int(e)) for i in range(len(clean.layers)) for e in np.unique(clean.experts[i, :len(prompts[0])])
            if e not in clean.experts[i, rows_of_second])
        layer = clean.layers[layer_index]
        flip_byte(engine.pack.experts_path, engine.pack.expert_record(layer, expert).offset + 123)

        calls = Counter()
        record = capture.record
        capture.record = lambda layer_, experts, weights: (calls.update([layer_]), record(layer_, experts, weights))
        with pytest.raises(StepDamaged) as failed:
            step()
        damaged = capture.step()
    finally:
        capture.enabled = False
        del capture.record
    assert set(failed.value.inputs) == {0} and failed.value.logits[1] is not None  # the second one was spared
    assert [(r.layer, r.expert, r.found_by) for r in engine.pack.damage.records()] == [(layer, expert, "load")]
    assert calls == Counter({moe_layer: 1 for moe_layer in clean.layers})  # once each, the restarted one too
    np.testing.assert_array_equal(damaged.experts[:layer_index + 1], clean.experts[:layer_index + 1])
    assert expert in damaged.experts[layer_index]
