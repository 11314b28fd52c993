"""The step plan (engine/step_plan.py) on its own: which running sequences take part in the
next step, with which tokens, within which prompt token budget. The sequences are real ones
of a batch over the demo model; the batch's step only moves them on between plans."""

from __future__ import annotations

import numpy as np
import pytest

from colibrid.engine.generate import GenerationEvent
from colibrid.engine.sampling import SamplingParams
from colibrid.engine.step_plan import IDLE_PREFILL_CHUNKS, StepPlan, plan_step

BIG_BUDGET = 1 << 34
CHUNK = 16
PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def demo_engine(demo_pack):
    from colibrid.engine.engine import load

    return load(demo_pack)


@pytest.fixture
def batch(demo_engine):
    return demo_engine.new_batch(max_batch=8, prefill_chunk=CHUNK, kv_budget_bytes=BIG_BUDGET)


def _admit(batch, engine, key, prompt: list[int]):
    generation, session = engine.start_generation(prompt, PARAMS)
    return batch.admit(key, generation, session)


def _rows(plan: StepPlan) -> list[tuple]:
    """The plan as (key, token ids, is_prompt, samples, ends_prompt_chunk) per sequence."""
    return [(rows.sequence.key, rows.token_ids.tolist(), rows.is_prompt, rows.samples, rows.ends_prompt_chunk)
            for rows in plan]


def _last_sampled(outcomes) -> dict:
    """key -> the token id its sequence sampled in a step's outcomes."""
    return {sequence.key: [o.token_id for o in produced if isinstance(o, GenerationEvent)][-1]
            for sequence, produced in outcomes if produced}


def test_decoding_sequences_feed_their_last_token_beside_a_long_prompt_cut_in_chunks(batch, demo_engine):
    _admit(batch, demo_engine, "a", [5, 6, 7])
    _admit(batch, demo_engine, "b", [8, 9])
    sampled = _last_sampled(batch.step())  # both prompts whole, one token each
    long_prompt = list(range(10, 50))  # 40 tokens: chunks of 16, 16 and 8
    _admit(batch, demo_engine, "long", long_prompt)

    plan = batch.plan_step()
    assert plan.prompt_token_budget == CHUNK  # someone decodes: one chunk of prompt a step
    assert _rows(plan) == [("a", [sampled["a"]], False, True, False),
                           ("b", [sampled["b"]], False, True, False),
                           ("long", long_prompt[:16], True, False, True)]
    assert [rows.tokens for rows in plan] == [1, 1, 16] and plan.prompt_tokens == 16

    sampled = _last_sampled(batch.step())
    assert _rows(batch.plan_step()) == [("a", [sampled["a"]], False, True, False),
                                        ("b", [sampled["b"]], False, True, False),
                                        ("long", long_prompt[16:32], True, False, True)]
    sampled = _last_sampled(batch.step())
    # The prompt's last chunk is short: it is not a cut, and its last token's logits are sampled.
    assert _rows(batch.plan_step())[2] == ("long", long_prompt[32:], True, True, False)
    sampled = _last_sampled(batch.step())
    assert _rows(batch.plan_step())[2] == ("long", [sampled["long"]], False, True, False)


def test_planning_takes_nothing_and_gives_the_same_plan_twice(batch, demo_engine):
    sequence = _admit(batch, demo_engine, "long", list(range(10, 50)))
    first, second = batch.plan_step(), plan_step(batch.sequences, CHUNK)
    assert _rows(first) == _rows(second)
    assert sequence.generation.pending_tokens == 40
    batch.step()  # takes the planned chunk; the plan's ids stay what they were
    assert first.rows[0].token_ids.tolist() == list(range(10, 26))
    assert sequence.generation.pending_tokens == 24


def test_while_nobody_decodes_a_step_takes_idle_prefill_chunks_of_prompt(batch, demo_engine):
    prompts = [list(range(10 + i, 10 + i + CHUNK)) for i in range(IDLE_PREFILL_CHUNKS + 1)]
    for i, prompt in enumerate(prompts):
        _admit(batch, demo_engine, i, prompt)

    plan = batch.plan_step()
    assert plan.prompt_token_budget == IDLE_PREFILL_CHUNKS * CHUNK
    assert _rows(plan) == [(i, prompts[i], True, True, True) for i in range(IDLE_PREFILL_CHUNKS)]
    assert plan.prompt_tokens == plan.prompt_token_budget  # the last prompt waits for the next step

    batch.step()
    plan = batch.plan_step()  # now some decode: one chunk of prompt at most
    assert plan.prompt_token_budget == CHUNK
    assert [(key, is_prompt) for key, _, is_prompt, _, _ in _rows(plan)] == \
        [(i, False) for i in range(IDLE_PREFILL_CHUNKS)] + [(IDLE_PREFILL_CHUNKS, True)]


def test_a_prompt_that_does_not_fit_the_budget_holds_back_the_prompts_after_it(batch, demo_engine):
    _admit(batch, demo_engine, "decoding", [5, 6, 7])
    batch.step()
    _admit(batch, demo_engine, "first", list(range(10, 20)))  # 10 tokens: fits in 16
    _admit(batch, demo_engine, "second", list(range(20, 30)))  # 10 more: only 6 left
    _admit(batch, demo_engine, "third", [30, 31, 32])  # would fit, but comes after "second"
    plan = batch.plan_step()
    assert [(key, len(ids)) for key, ids, *_ in _rows(plan)] == [("decoding", 1), ("first", 10)]
    assert plan.prompt_tokens == 10 <= plan.prompt_token_budget == CHUNK


def test_a_sequence_resumed_from_a_kept_prefix_is_cut_every_chunk_of_what_remains(demo_engine):
    batch = demo_engine.new_batch(max_batch=8, prefill_chunk=CHUNK, kv_budget_bytes=BIG_BUDGET,
                                  prefix_cache_bytes=BIG_BUDGET)
    prompt = list(range(10, 30))
    generation, session = demo_engine.start_generation(prompt, SamplingParams(temperature=0.0, max_tokens=2))
    batch.admit("first", generation, session)
    while len(batch):
        batch.step()  # ends normally: its state is kept
    generation, session = demo_engine.start_generation(prompt + list(range(40, 60)), PARAMS)
    batch.admit("again", generation, session)
    skipped = generation.cached_prompt_tokens
    assert skipped > 0
    rows = batch.plan_step().rows[0]
    assert rows.token_ids.tolist() == (prompt + list(range(40, 60)))[skipped:skipped + CHUNK]


def test_an_empty_batch_plans_an_empty_step(batch):
    plan = batch.plan_step()
    assert len(plan) == 0 and not plan and plan.prompt_tokens == 0
    assert batch.step() == []


def test_the_planner_refuses_a_chunk_of_no_tokens():
    with pytest.raises(ValueError, match="prefill_chunk"):
        plan_step([], 0)


def test_the_planned_token_ids_are_int32_one_chunk_long(batch, demo_engine):
    _admit(batch, demo_engine, "long", list(range(10, 50)))
    ids = batch.plan_step().rows[0].token_ids
    assert ids.dtype == np.int32 and ids.shape == (CHUNK,)
