"""Continuous batching in the engine (engine/batch.py, Model.forward_batch): a request's tokens
do not depend on what else runs, prompts are fed in bounded chunks beside the others' tokens,
the KV budget admits and refuses, and the step reports how much the sequences share experts."""

from __future__ import annotations

import numpy as np
import pytest

from colibrid.engine.generate import GenerationDone, GenerationEvent
from colibrid.engine.sampling import SamplingParams
from tests.tiny_checkpoints import CheckpointSpec

# One architecture per kind of sequence state: full KV (OLMoE), a ring of a sliding window
# (gpt-oss: window 4 on every other layer, sinks), MLA latents (DeepSeek-V3), DeltaNet's
# recurrent and conv state beside gated full attention (Qwen3.5).
STATE_KINDS = [
    CheckpointSpec("olmoe", {}),
    CheckpointSpec("gpt_oss", {"sliding_window": 4}),
    CheckpointSpec("deepseek_v3", {"num_hidden_layers": 3}),
    CheckpointSpec("qwen3_5_moe", {}),
]
BIG_BUDGET = 1 << 34


def _requests(vocab_size: int) -> list[tuple[list[int], SamplingParams]]:
    """Eight requests with different prompts (3 to 24 tokens), lengths, seeds and sampling."""
    rng = np.random.default_rng(7)
    requests = []
    for i in range(8):
        prompt = rng.integers(3, vocab_size, size=3 + 3 * i).tolist()
        sampling = dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.9, top_p=0.9, seed=100 + i)
        requests.append((prompt, SamplingParams(max_tokens=6 + i, ignore_eos=True, logprobs=2, **sampling)))
    return requests


def _run(engine, requests, max_batch: int, prefill_chunk: int, join_every: int) -> list[list]:
    """Runs ``requests`` through one batch, request i joining at step join_every * i (as soon
    after as there is room); returns each request's outcomes in order."""
    batch = engine.new_batch(max_batch, prefill_chunk, BIG_BUDGET)
    outcomes: list[list] = [[] for _ in requests]
    waiting = list(enumerate(requests))
    step = 0
    while waiting or len(batch):
        while waiting and step >= join_every * waiting[0][0] and batch.has_room(0):
            i, (prompt, params) = waiting.pop(0)
            generation, session = engine.start_generation(prompt, params)
            batch.admit(i, generation, session)
        for sequence, produced in batch.step():
            outcomes[sequence.key].extend(produced)
        step += 1
    return outcomes


def _summary(outcomes: list) -> tuple:
    """Everything a client sees of a request: ids, logprobs and alternatives, text, the end."""
    events = [o for o in outcomes if isinstance(o, GenerationEvent)]
    done = outcomes[-1]
    assert isinstance(done, GenerationDone)
    return ([(e.token_id, e.text, e.logprob, e.top_logprobs) for e in events],
            done.finish_reason, done.text, done.generated_tokens, done.prompt_tokens)


@pytest.mark.parametrize("quant", ["q8_0", "q4_g64"])
@pytest.mark.parametrize("spec", STATE_KINDS, ids=lambda s: s.name)
def test_a_request_among_seven_others_gets_exactly_its_tokens_alone(spec, quant, packs):
    from colibrid.engine.engine import Engine
    from colibrid.pack.reader import Pack

    engine = Engine(Pack.open(packs.pack(spec, quant)))
    requests = _requests(engine.config.vocab_size)
    alone = [_run(engine, [request], max_batch=1, prefill_chunk=5, join_every=0)[0] for request in requests]
    batched = _run(engine, requests, max_batch=8, prefill_chunk=5, join_every=2)  # staggered, chunked
    for i, (a, b) in enumerate(zip(alone, batched)):
        assert _summary(a) == _summary(b), f"request {i}"
    assert engine.model.routing_stats.layer_steps > 0
    if spec.arch != "qwen3_5_moe":  # the others' numbers do not depend on where a prompt is cut either
        whole_prompt = [list(engine.generate(prompt, params)) for prompt, params in requests]
        assert [_summary(o) for o in whole_prompt] == [_summary(o) for o in alone]


def test_batches_smaller_than_the_requests_queue_them_and_change_nothing(packs):
    from colibrid.engine.engine import Engine
    from colibrid.pack.reader import Pack

    engine = Engine(Pack.open(packs.pack(STATE_KINDS[0], "q8_0")))
    requests = _requests(engine.config.vocab_size)
    one_by_one = _run(engine, requests, max_batch=1, prefill_chunk=512, join_every=0)
    three_at_a_time = _run(engine, requests, max_batch=3, prefill_chunk=7, join_every=0)
    assert [_summary(o) for o in one_by_one] == [_summary(o) for o in three_at_a_time]


@pytest.fixture(scope="module")
def demo_engine(demo_pack):
    from colibrid.engine.engine import load

    return load(demo_pack)


def test_a_long_prompt_is_fed_in_chunks_while_the_others_keep_their_token_per_step(demo_engine):
    engine = demo_engine
    batch = engine.new_batch(max_batch=4, prefill_chunk=16, kv_budget_bytes=BIG_BUDGET)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    decoding, session = engine.start_generation([5, 6, 7], params)
    batch.admit("decoding", decoding, session)
    batch.step()  # its prompt; it has sampled its first token
    long_prompt = list(range(10, 10 + 100))
    generation, session = engine.start_generation(long_prompt, params)
    batch.admit("long", generation, session)
    steps_while_prefilling = 0
    while generation.prefilling:
        tokens_before, pending_before = decoding.generated_tokens, generation.pending_tokens
        batch.step()
        steps_while_prefilling += 1
        assert decoding.generated_tokens == tokens_before + 1  # never a step without its token
        assert pending_before - generation.pending_tokens <= 16  # at most prefill_chunk prompt tokens a step
    assert steps_while_prefilling == -(-len(long_prompt) // 16)


def test_prompts_arriving_together_share_a_step_until_someone_decodes(demo_engine):
    from colibrid.engine.step_plan import IDLE_PREFILL_CHUNKS

    engine = demo_engine
    chunk = 16
    batch = engine.new_batch(max_batch=8, prefill_chunk=chunk, kv_budget_bytes=BIG_BUDGET)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    together = IDLE_PREFILL_CHUNKS + 1  # one prompt more than an idle step takes
    generations = []
    for i in range(together):
        generation, session = engine.start_generation(list(range(10 + i, 10 + i + chunk)), params)
        batch.admit(i, generation, session)
        generations.append(generation)
    long_prompt, session = engine.start_generation(list(range(40, 40 + 3 * chunk)), params)
    batch.admit("long", long_prompt, session)

    batch.step()  # nobody decodes yet: IDLE_PREFILL_CHUNKS whole prompts, their first tokens together
    assert [g.generated_tokens for g in generations] == [1] * IDLE_PREFILL_CHUNKS + [0]
    assert generations[-1].pending_tokens == chunk and long_prompt.pending_tokens == 3 * chunk

    batch.step()  # now some decode: one chunk of prompt, the next in arrival order
    assert [g.generated_tokens for g in generations] == [2] * IDLE_PREFILL_CHUNKS + [1]
    assert long_prompt.pending_tokens == 3 * chunk
    while long_prompt.prefilling:
        pending = long_prompt.pending_tokens
        batch.step()
        assert pending - long_prompt.pending_tokens <= chunk  # its own cuts, one chunk a step


def test_a_long_prompt_alone_is_still_fed_one_chunk_a_step(demo_engine):
    engine = demo_engine
    batch = engine.new_batch(max_batch=4, prefill_chunk=16, kv_budget_bytes=BIG_BUDGET)
    generation, session = engine.start_generation(list(range(10, 60)), SamplingParams(temperature=0.0, max_tokens=2))
    batch.admit("long", generation, session)
    fed = []
    while generation.prefilling:
        pending = generation.pending_tokens
        batch.step()
        fed.append(pending - generation.pending_tokens)
    assert len(fed) == 4 and fed[:3] == [16, 16, 16]  # 50 tokens; the last step also samples a token


def test_the_kv_budget_admits_what_fits_and_refuses_what_never_can(demo_engine):
    from colibrid.engine.batch import KVBudgetExceeded

    engine = demo_engine
    params = SamplingParams(temperature=0.0, max_tokens=20)
    generation, session = engine.start_generation([5, 6, 7], params)
    need = session.state.nbytes
    assert need == engine.model.new_state(3 + 20).nbytes > 0  # prompt + max_tokens, allocated up front
    batch = engine.new_batch(max_batch=8, prefill_chunk=64, kv_budget_bytes=2 * need)
    batch.check_fits_alone(need)
    with pytest.raises(KVBudgetExceeded, match="kv_cache_size"):
        batch.check_fits_alone(2 * need + 1)
    batch.admit("a", generation, session)
    assert batch.has_room(need)
    batch.admit("b", *engine.start_generation([8, 9, 10], params))
    assert not batch.has_room(need) and batch.kv_status()["used_bytes"] == 2 * need
    batch.remove("a")
    assert batch.has_room(need) and batch.kv_status()["used_bytes"] == need


def test_a_sequence_state_holds_max_context_tokens_at_most(demo_engine):
    generation, session = demo_engine.start_generation([1, 2], SamplingParams(max_tokens=10**9))
    assert session.max_context == demo_engine.max_context


def test_the_step_reports_how_much_its_sequences_share_experts(demo_engine):
    engine = demo_engine
    stats = engine.model.routing_stats
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    batch = engine.new_batch(max_batch=8, prefill_chunk=256, kv_budget_bytes=BIG_BUDGET)
    for i in range(6):
        batch.admit(i, *engine.start_generation([3 + i, 40 + 7 * i, 90 + i], params))
    steps_before, distinct_before, sequence_before = stats.layer_steps, stats.distinct_experts, stats.sequence_experts
    while len(batch):
        batch.step()
    distinct = stats.distinct_experts - distinct_before
    summed = stats.sequence_experts - sequence_before
    top_k, experts = engine.config.num_experts_per_tok, engine.config.num_experts
    layer_steps = stats.layer_steps - steps_before
    assert layer_steps == batch.steps * engine.config.num_layers
    assert layer_steps * top_k <= distinct <= layer_steps * experts
    assert distinct < summed <= layer_steps * 6 * experts  # six sequences share some experts every step
    status = batch.status()
    assert status["max_batch"] == 8 and status["size"] == 0 and status["steps"] == batch.steps
    assert 0 < status["distinct_experts_per_layer_step"] <= status["sequence_experts_per_layer_step"]


def test_the_batched_attention_call_refuses_rows_that_do_not_add_up(demo_engine):
    from colibrid import native

    attention = demo_engine.model.layers[0].mixer
    state = attention.new_state(8, 8)
    x = np.zeros((3, demo_engine.config.hidden_size), np.float32)
    cos, sin = attention.rotary.cos_sin(np.arange(3))
    with pytest.raises(native.InvalidArgumentError, match="add up to 2"):
        native.attention_block_batch(attention.fused, x, cos, sin, [(*state.buffers(0, 2), 0, 2, False)])


@pytest.mark.parametrize("n_slots", [1, 3])  # fewer than one token's top-k; fewer than a batch step's experts
def test_a_batch_through_a_tiny_expert_cache_gets_the_same_tokens(n_slots, packs):
    from colibrid.engine.engine import Engine
    from colibrid.engine.experts.cache import CachedExpertSource
    from colibrid.pack.reader import Pack

    path = packs.pack(STATE_KINDS[0], "q8_0")
    reference = Engine(Pack.open(path))
    requests = _requests(reference.config.vocab_size)
    expected = [_summary(o) for o in _run(reference, requests, max_batch=8, prefill_chunk=5, join_every=1)]
    pack = Pack.open(path)
    slot_bytes = -(-pack.manifest.expert_records[0].length // 4096) * 4096
    with CachedExpertSource(pack, n_slots * slot_bytes, hugepages="off") as source:
        cached = Engine(pack, experts=source)
        assert [_summary(o) for o in _run(cached, requests, max_batch=8, prefill_chunk=5, join_every=1)] == expected
        assert source.stats()["total"]["evictions"] > 0  # the steps' experts really came through a full cache
