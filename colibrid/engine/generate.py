"""The generation loop: prefill, then sample-and-feed one token at a time, streaming text.

It knows nothing about the model. A session is anything with

    forward(token_ids: np.ndarray int32 (T,)) -> np.ndarray float32 (T, V)
        appends the tokens to the session's KV cache and returns their logits;
        if it also accepts `all_logits=False`, prefill asks for the last row only
        (the other T-1 rows of a long prompt cost a full vocabulary projection each)
    n_past: int          tokens already in the KV cache
    max_context: int     tokens the KV cache can hold

`generate()` is a generator: the caller streams events as they come and may stop at any
time by closing it (or just dropping it); nothing is left half-done, because the only work
between yields is one forward call.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from colibrid.engine.sampling import Sampler, SamplingParams, StopMatcher
from colibrid.engine.tokenizer import IncrementalDecoder, Tokenizer

logger = logging.getLogger(__name__)

FinishReason = Literal["stop", "length", "eos", "context"]


class GenerationSession(Protocol):
    n_past: int
    max_context: int

    def forward(self, token_ids: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class GenerationEvent:
    """One sampled token.

    `text` is the new text it makes visible; "" while an unfinished UTF-8 character or a
    possible stop string is held back (a later event releases it). The concatenation of all
    events' text is GenerationDone.text. An end-of-sequence token gets an event too (with its
    logprob) but its own text is never shown: its `text` only releases held-back text.
    """

    token_id: int
    text: str
    logprob: float  # log-softmax of the raw model logits, see Sampler.sample
    top_logprobs: list[tuple[int, float]] | None


@dataclass(frozen=True)
class GenerationDone:
    """The last item of a generation.

    finish_reason: "eos" (the model ended), "stop" (a stop string appeared; it is not in
    `text`), "length" (max_tokens generated), "context" (the KV cache is full).
    generated_tokens counts every sampled token, the final EOS included - one per event.
    """

    finish_reason: FinishReason
    prompt_tokens: int
    generated_tokens: int
    time_to_first_token_s: float  # from the start of prefill to the first sampled token
    decode_tokens_per_s: float  # tokens after the first / the time they took; 0 if only one
    text: str


def generate(
    session: GenerationSession,
    tokenizer: Tokenizer,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    skip_special_tokens: bool = True,
) -> Iterator[GenerationEvent | GenerationDone]:
    """Generate a continuation of `prompt_ids`, yielding a GenerationEvent per token, then a GenerationDone.

    `prompt_ids` are appended to whatever the session already holds. Raises ValueError before
    doing any work if the parameters are invalid, the prompt is empty, or it does not fit.
    Special tokens other than EOS (e.g. a stray <|im_start|>) are left out of the text
    unless `skip_special_tokens` is False.
    """
    params.validate()
    _check_prompt_fits(session, prompt_ids)
    return _generate(session, tokenizer, list(prompt_ids), params, skip_special_tokens)


def _check_prompt_fits(session: GenerationSession, prompt_ids: Sequence[int]) -> None:
    if len(prompt_ids) == 0:
        raise ValueError("the prompt is empty; at least one token is needed to predict the next")
    free_tokens = session.max_context - session.n_past
    if len(prompt_ids) > free_tokens:
        raise ValueError(
            f"the prompt has {len(prompt_ids)} tokens but the context has room for {free_tokens} "
            f"(max_context {session.max_context}, {session.n_past} already used)"
        )


def tokens_possible(session: GenerationSession, prompt_tokens: int, params: SamplingParams) -> int:
    """The most tokens a generation of `prompt_tokens` can sample: max_tokens, bounded by the context.

    After the prompt, each sampled token but the last is fed back into the KV cache; the last
    one sampled when the cache is full ends the generation ("context"), hence the + 1.
    """
    free_after_prompt = session.max_context - session.n_past - prompt_tokens
    return min(params.max_tokens, free_after_prompt + 1)


@dataclass
class _Counters:
    """Timing and counts of one generation, for GenerationDone."""

    start_s: float
    first_token_s: float | None = None
    last_token_s: float | None = None
    generated_tokens: int = 0

    def token_sampled(self) -> None:
        now = time.perf_counter()
        if self.first_token_s is None:
            self.first_token_s = now
        self.last_token_s = now
        self.generated_tokens += 1

    def time_to_first_token_s(self) -> float:
        return 0.0 if self.first_token_s is None else self.first_token_s - self.start_s

    def decode_tokens_per_s(self) -> float:
        if self.generated_tokens < 2 or self.first_token_s is None or self.last_token_s is None:
            return 0.0
        elapsed_s = self.last_token_s - self.first_token_s
        return (self.generated_tokens - 1) / elapsed_s if elapsed_s > 0 else 0.0


def _generate(
    session: GenerationSession,
    tokenizer: Tokenizer,
    prompt_ids: list[int],
    params: SamplingParams,
    skip_special_tokens: bool,
) -> Iterator[GenerationEvent | GenerationDone]:
    sampler = Sampler(params)
    decoder = IncrementalDecoder(tokenizer, skip_special_tokens=skip_special_tokens)
    stop_matcher = StopMatcher(params.stop)
    eos_ids = frozenset() if params.ignore_eos else tokenizer.eos_token_ids
    # Every id so far, for the repetition penalty: one preallocated buffer, no per-step copies.
    # Sized by what can really be generated, never by max_tokens alone (a client may send 2**64-1).
    history = np.empty(len(prompt_ids) + tokens_possible(session, len(prompt_ids), params),
                       dtype=np.int64)  # (prompt + generated,)
    history[: len(prompt_ids)] = prompt_ids
    history_len = len(prompt_ids)
    counters = _Counters(start_s=time.perf_counter())
    text_parts: list[str] = []

    forward_last = _last_logits_forward(session)
    logits = forward_last(np.asarray(prompt_ids, dtype=np.int32))
    try:
        while True:
            sampled = sampler.sample(logits, history[:history_len])
            counters.token_sampled()
            history[history_len] = sampled.token_id
            history_len += 1

            is_eos = sampled.token_id in eos_ids
            text, stopped = stop_matcher.push("" if is_eos else decoder.push(sampled.token_id))
            finish_reason = _finish_reason(is_eos, stopped, counters.generated_tokens, session, params)
            if finish_reason in ("eos", "length", "context"):
                # Nothing follows: release what was held back for a character or stop string to finish.
                tail, stopped = stop_matcher.push(decoder.flush())
                text += tail + stop_matcher.flush()
                finish_reason = "stop" if stopped else finish_reason
            text_parts.append(text)
            yield GenerationEvent(sampled.token_id, text, sampled.logprob, sampled.top_logprobs)

            if finish_reason is not None:
                break
            logits = forward_last(np.asarray([sampled.token_id], dtype=np.int32))
    except GeneratorExit:
        logger.debug("generation closed by the consumer after %d tokens", counters.generated_tokens)
        raise

    yield GenerationDone(
        finish_reason=finish_reason,
        prompt_tokens=len(prompt_ids),
        generated_tokens=counters.generated_tokens,
        time_to_first_token_s=counters.time_to_first_token_s(),
        decode_tokens_per_s=counters.decode_tokens_per_s(),
        text="".join(text_parts),
    )


def _finish_reason(
    is_eos: bool, stopped: bool, generated_tokens: int, session: GenerationSession, params: SamplingParams
) -> FinishReason | None:
    """Why the generation ends after this token, or None if it goes on. The first reason wins."""
    if is_eos:
        return "eos"
    if stopped:
        return "stop"
    if generated_tokens >= params.max_tokens:
        return "length"
    if session.n_past >= session.max_context:
        # The token just sampled has no room in the KV cache, so nothing can follow it.
        return "context"
    return None


def _last_logits_forward(session: GenerationSession) -> Callable[[np.ndarray], np.ndarray]:
    """A function: token ids (T,) -> logits (V,) of the last one, after appending all to the session."""
    try:
        accepts_all_logits = "all_logits" in inspect.signature(session.forward).parameters
    except (TypeError, ValueError):  # builtins and C extensions may have no signature
        accepts_all_logits = False

    def forward_last(token_ids: np.ndarray) -> np.ndarray:
        if accepts_all_logits:
            return np.asarray(session.forward(token_ids, all_logits=False))[-1]
        return np.asarray(session.forward(token_ids))[-1]

    return forward_last
