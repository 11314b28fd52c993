"""The generation loop against scripted sessions: finish reasons, usage, streaming text, early close."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from colibrid.engine.generate import GenerationDone, GenerationEvent, generate
from colibrid.engine.sampling import SamplingParams
from colibrid.engine.text.incremental_decoder import REPLACEMENT_CHAR
from colibrid.engine.text.tokenizer import Tokenizer

GREEDY = dict(temperature=0.0)


class ScriptedSession:
    """A fake model that predicts `script[k]` as the k-th generated token, whatever it is fed.

    It keeps the session protocol strictly: int32 (T,) in, float32 (T, V) out, and it refuses
    to grow past max_context, as a real KV cache would.
    """

    def __init__(self, vocab_size: int, script: list[int], max_context: int = 1024) -> None:
        self.vocab_size = vocab_size
        self.script = script
        self.max_context = max_context
        self.n_past = 0
        self.calls: list[np.ndarray] = []

    def forward(self, token_ids: np.ndarray) -> np.ndarray:
        assert isinstance(token_ids, np.ndarray) and token_ids.dtype == np.int32 and token_ids.ndim == 1
        assert self.n_past + len(token_ids) <= self.max_context, "KV cache overflow"
        self.calls.append(token_ids.copy())
        self.n_past += len(token_ids)
        logits = np.zeros((len(token_ids), self.vocab_size), dtype=np.float32)  # (T, V)
        next_token = self.script[(len(self.calls) - 1) % len(self.script)]
        logits[-1, next_token] = 12.0
        return logits


class LastRowOnlySession(ScriptedSession):
    """A session that, like the real one, can skip the prompt's other rows."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.all_logits_flags: list[bool] = []

    def forward(self, token_ids: np.ndarray, all_logits: bool = True) -> np.ndarray:
        self.all_logits_flags.append(all_logits)
        logits = super().forward(token_ids)
        return logits if all_logits else logits[-1:]


class RandomLogitsSession(ScriptedSession):
    """Logits that depend only on the position, so two runs see the same distributions."""

    def forward(self, token_ids: np.ndarray) -> np.ndarray:
        super().forward(token_ids)
        rng = np.random.default_rng(self.n_past)
        return rng.standard_normal((len(token_ids), self.vocab_size)).astype(np.float32)


@pytest.fixture(scope="module")
def tokenizer(bytelevel_dir) -> Tokenizer:
    return Tokenizer.from_dir(bytelevel_dir)


@pytest.fixture(scope="module")
def eos(tokenizer) -> int:
    return tokenizer.token_to_id("<|im_end|>")


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": "Say something."}])


def _run(session, tokenizer, prompt, **params) -> tuple[list[GenerationEvent], GenerationDone]:
    items = list(generate(session, tokenizer, prompt, SamplingParams(**params)))
    events, done = items[:-1], items[-1]
    assert all(isinstance(event, GenerationEvent) for event in events)
    assert isinstance(done, GenerationDone)
    assert "".join(event.text for event in events) == done.text
    return events, done


def test_eos_ends_and_its_text_is_not_emitted(tokenizer, eos, prompt):
    reply = tokenizer.encode("Hello world, this is a test.", add_special_tokens=False)
    session = ScriptedSession(tokenizer.vocab_size, reply + [eos] + reply)
    events, done = _run(session, tokenizer, prompt, **GREEDY)

    assert done.finish_reason == "eos"
    assert done.text == "Hello world, this is a test."
    assert [event.token_id for event in events] == reply + [eos]
    assert events[-1].text == ""
    assert (done.prompt_tokens, done.generated_tokens) == (len(prompt), len(reply) + 1)
    # One prefill with the whole prompt, then one call per fed token; the EOS is never fed.
    assert list(session.calls[0]) == prompt
    assert [len(call) for call in session.calls[1:]] == [1] * len(reply)
    assert [int(call[0]) for call in session.calls[1:]] == reply
    assert done.time_to_first_token_s >= 0 and done.decode_tokens_per_s > 0


def test_any_of_several_eos_ids_ends(tokenizer, prompt):
    other_eos = tokenizer.token_to_id("<|endoftext|>")
    assert other_eos in tokenizer.eos_token_ids
    session = ScriptedSession(tokenizer.vocab_size, tokenizer.encode("ok", add_special_tokens=False) + [other_eos])
    _, done = _run(session, tokenizer, prompt, **GREEDY)
    assert done.finish_reason == "eos" and done.text == "ok"


def test_ignore_eos_runs_to_max_tokens(tokenizer, eos, prompt):
    reply = tokenizer.encode("Hi.", add_special_tokens=False)
    session = ScriptedSession(tokenizer.vocab_size, reply + [eos])
    events, done = _run(session, tokenizer, prompt, ignore_eos=True, max_tokens=2 * (len(reply) + 1), **GREEDY)
    assert done.finish_reason == "length"
    assert done.generated_tokens == len(events) == 2 * (len(reply) + 1)
    assert done.text == "Hi.Hi."  # the EOS token is special, so it adds no text


def test_stop_string_ends_before_the_stop_text(tokenizer, eos, prompt):
    reply = tokenizer.encode("Hello world, this is a test.", add_special_tokens=False)
    session = ScriptedSession(tokenizer.vocab_size, reply + [eos])
    events, done = _run(session, tokenizer, prompt, stop=["is a"], **GREEDY)
    assert done.finish_reason == "stop"
    assert done.text == "Hello world, this "
    assert len(events) < len(reply)
    assert tokenizer.decode([event.token_id for event in events]).endswith("is a")


def test_max_tokens_ends_with_length(tokenizer, eos, prompt):
    reply = tokenizer.encode("Hello world, this is a test.", add_special_tokens=False)
    session = ScriptedSession(tokenizer.vocab_size, reply + [eos])
    events, done = _run(session, tokenizer, prompt, max_tokens=3, **GREEDY)
    assert done.finish_reason == "length"
    assert [event.token_id for event in events] == reply[:3]
    assert done.text == tokenizer.decode(reply[:3])
    assert done.generated_tokens == 3


def test_full_context_ends_with_context(tokenizer, eos, prompt):
    reply = tokenizer.encode("Hello world, this is a test.", add_special_tokens=False)
    session = ScriptedSession(tokenizer.vocab_size, reply + [eos], max_context=len(prompt) + 2)
    events, done = _run(session, tokenizer, prompt, **GREEDY)
    assert done.finish_reason == "context"
    # Two generated tokens fit in the cache; the third is sampled from the last logits but cannot be fed.
    assert [event.token_id for event in events] == reply[:3]
    assert session.n_past == session.max_context


def test_prompt_filling_the_context_still_yields_one_token(tokenizer, eos, prompt):
    session = ScriptedSession(tokenizer.vocab_size, [5], max_context=len(prompt))
    events, done = _run(session, tokenizer, prompt, **GREEDY)
    assert done.finish_reason == "context" and len(events) == 1


def test_length_wins_over_context_on_the_same_token(tokenizer, eos, prompt):
    session = ScriptedSession(tokenizer.vocab_size, [5, 6, 7], max_context=len(prompt) + 1)
    _, done = _run(session, tokenizer, prompt, max_tokens=2, **GREEDY)
    assert done.finish_reason == "length"


@pytest.mark.parametrize("max_tokens", [2**32, 2**64 - 1], ids=["2**32", "uint64-max"])
def test_a_huge_max_tokens_is_bounded_by_the_context_without_allocating_for_it(tokenizer, prompt, max_tokens):
    session = ScriptedSession(tokenizer.vocab_size, [5, 6, 7], max_context=len(prompt) + 4)
    tracemalloc.start()
    try:
        events, done = _run(session, tokenizer, prompt, max_tokens=max_tokens, **GREEDY)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert done.finish_reason == "context" and len(events) == 5
    assert peak_bytes < 1 << 20  # nothing in proportion to max_tokens (2**32 int64 ids would be 32 GiB)


def test_bad_requests_fail_before_any_work(tokenizer, prompt):
    session = ScriptedSession(tokenizer.vocab_size, [5], max_context=len(prompt) - 1)
    with pytest.raises(ValueError, match="context has room for"):
        generate(session, tokenizer, prompt, SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        generate(session, tokenizer, [], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        generate(session, tokenizer, prompt[:2], SamplingParams(top_p=2.0))
    assert session.calls == []


def test_closing_early_is_clean(tokenizer, eos, prompt):
    reply = tokenizer.encode("Hello world, this is a test.", add_special_tokens=False)
    session = ScriptedSession(tokenizer.vocab_size, reply + [eos])
    stream = generate(session, tokenizer, prompt, SamplingParams(**GREEDY))
    first, second = next(stream), next(stream)
    assert (first.token_id, second.token_id) == tuple(reply[:2])
    stream.close()
    assert len(session.calls) == 2  # prefill and the first token; nothing ran after the close
    with pytest.raises(StopIteration):
        next(stream)
    generate(session, tokenizer, [1], SamplingParams()).close()  # closing before starting is fine too


def test_multibyte_text_is_streamed_whole(tokenizer, eos, prompt):
    text = "🦀𝄞 漢字 and é"
    reply = tokenizer.encode(text, add_special_tokens=False)
    session = ScriptedSession(tokenizer.vocab_size, reply + [eos])
    events, done = _run(session, tokenizer, prompt, **GREEDY)
    assert done.text == text
    assert any(event.text == "" for event in events[:-1])  # characters split across tokens were held
    assert not any(REPLACEMENT_CHAR in event.text for event in events)


def test_text_held_for_a_possible_stop_is_released_at_the_end(tokenizer, eos, prompt):
    reply = tokenizer.encode("value #", add_special_tokens=False)
    session = ScriptedSession(tokenizer.vocab_size, reply + [eos])
    events, done = _run(session, tokenizer, prompt, stop=["##"], **GREEDY)
    assert done.finish_reason == "eos"
    assert done.text == "value #"
    assert events[-1].token_id == eos and events[-1].text.endswith("#")


def test_logprobs_are_reported_per_token(tokenizer, eos, prompt):
    reply = tokenizer.encode("Hi", add_special_tokens=False)
    session = ScriptedSession(tokenizer.vocab_size, reply + [eos])
    events, _ = _run(session, tokenizer, prompt, logprobs=2, **GREEDY)
    for event in events:
        assert len(event.top_logprobs) == 2
        assert event.top_logprobs[0][0] == event.token_id
        expected = 12.0 - np.log(np.exp(12.0) + tokenizer.vocab_size - 1)
        assert event.logprob == pytest.approx(expected, abs=1e-5)


def test_prefill_asks_for_the_last_row_only_when_the_session_can(tokenizer, eos, prompt):
    reply = tokenizer.encode("Hi", add_special_tokens=False)
    session = LastRowOnlySession(tokenizer.vocab_size, reply + [eos])
    _, done = _run(session, tokenizer, prompt, **GREEDY)
    assert done.text == "Hi"
    assert session.all_logits_flags and not any(session.all_logits_flags)


def test_seeded_sampling_repeats(tokenizer, prompt):
    def tokens(seed):
        session = RandomLogitsSession(tokenizer.vocab_size, [0])
        events, _ = _run(session, tokenizer, prompt, seed=seed, max_tokens=20, ignore_eos=True, top_k=50)
        return [event.token_id for event in events]

    assert tokens(7) == tokens(7)
    assert tokens(7) != tokens(8)
