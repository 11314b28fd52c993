"""The generation loop: prefill, then sample-and-feed one token at a time, streaming text.

A Generation is one request's loop as a state machine (what to feed next, what a token's
logits mean); generate() drives one alone, the engine's batch drives many in one step.
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
from colibrid.engine.text.incremental_decoder import IncrementalDecoder
from colibrid.engine.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

FinishReason = Literal["stop", "length", "eos", "context", "cancelled"]


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
    `text`), "length" (max_tokens generated), "context" (the KV cache is full), "cancelled"
    (stopped by its client midway).
    generated_tokens counts every sampled token, the final EOS included - one per event.
    """

    finish_reason: FinishReason
    prompt_tokens: int
    generated_tokens: int
    time_to_first_token_s: float  # from the start of prefill to the first sampled token
    decode_tokens_per_s: float  # tokens after the first / the time they took; 0 if only one
    text: str
    cached_prompt_tokens: int = 0  # of prompt_tokens, those resumed from a kept prefix instead of prefilled


def generate(
    session: GenerationSession,
    tokenizer: Tokenizer,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    skip_special_tokens: bool = True,
) -> Iterator[GenerationEvent | GenerationDone]:
    """Generate a continuation of `prompt_ids`, yielding a GenerationEvent per token, then a GenerationDone.

    `prompt_ids` are appended to whatever the session already holds. Raises ValueError before
    doing any work if the prompt is empty or does not fit (SamplingParams were checked when built).
    Special tokens other than EOS (e.g. a stray <|im_start|>) are left out of the text
    unless `skip_special_tokens` is False.
    """
    generation = Generation(session, tokenizer, prompt_ids, params, skip_special_tokens)
    return _run_alone(session, generation)


def _run_alone(session: GenerationSession, generation: "Generation") -> Iterator[GenerationEvent | GenerationDone]:
    """Drives one generation with the session to itself: the whole prompt in one forward, then one token per forward."""
    forward_last = _last_logits_forward(session)
    try:
        while not generation.finished:
            yield from generation.accept(forward_last(generation.next_input()))
    except GeneratorExit:
        logger.debug("generation closed by the consumer after %d tokens", generation.generated_tokens)
        raise


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


class Generation:
    """One request's generation as a state machine that its driver steps: the driver feeds
    ``next_input()`` to the sequence's session (the whole prompt, or a chunk of it, then each
    sampled token) and hands the last fed token's logits to ``accept()``, which samples,
    streams text and decides whether the generation ends. It never calls the model itself, so
    the same object runs alone (generate()) or as one sequence of a batch (engine/batch.py),
    with the same tokens either way.
    """

    def __init__(self, session: GenerationSession, tokenizer: Tokenizer, prompt_ids: Sequence[int],
                 params: SamplingParams, skip_special_tokens: bool = True) -> None:
        _check_prompt_fits(session, prompt_ids)
        self.session = session  # read for its n_past and max_context only
        self.params = params
        self.prompt_tokens = len(prompt_ids)
        self._sampler = Sampler(params)
        self._decoder = IncrementalDecoder(tokenizer, skip_special_tokens=skip_special_tokens)
        self._stop_matcher = StopMatcher(params.stop)
        self._eos_ids = frozenset() if params.ignore_eos else tokenizer.eos_token_ids
        # Every id so far, for the repetition penalty: one preallocated buffer, no per-step copies.
        # Sized by what can really be generated, never by max_tokens alone (a client may send 2**64-1).
        self._history = np.empty(len(prompt_ids) + tokens_possible(session, len(prompt_ids), params),
                                 dtype=np.int64)  # (prompt + generated,)
        self._history[: len(prompt_ids)] = prompt_ids
        self._history_len = len(prompt_ids)
        self._pending = np.asarray(prompt_ids, dtype=np.int32)  # (n,) tokens not yet fed to the session
        self._counters = _Counters(start_s=time.perf_counter())
        self._text_parts: list[str] = []
        self.finished = False
        self.cached_prompt_tokens = 0  # the prompt's first tokens the session was resumed with (skip_cached)

    @property
    def generated_tokens(self) -> int:
        return self._counters.generated_tokens

    @property
    def decode_tokens_per_s(self) -> float:
        return self._counters.decode_tokens_per_s()

    @property
    def pending_tokens(self) -> int:
        """Tokens the session has yet to be fed before the next token can be sampled."""
        return self._pending.shape[0]

    @property
    def prompt_ids(self) -> np.ndarray:
        """The prompt's token ids, int64 (prompt_tokens,): a view, not to be written."""
        return self._history[: self.prompt_tokens]

    def fed_token_ids(self) -> np.ndarray:
        """A copy of the ids of every token the session holds: the prompt, then each sampled
        token fed back (all but the last sampled)."""
        return self._history[: self.session.n_past].copy()

    def skip_cached(self, tokens: int) -> None:
        """The session already holds the first ``tokens`` of the prompt (resumed from a kept
        prefix): they are not fed. Only before anything is fed, and at least one prompt token
        must remain (its logits give the first sample)."""
        if self.pending_tokens != self.prompt_tokens or self.session.n_past != tokens:
            raise RuntimeError("skip_cached() before anything is fed, with the session holding those tokens")
        if not 0 <= tokens < self.prompt_tokens:
            raise ValueError(f"can skip 0 .. {self.prompt_tokens - 1} of {self.prompt_tokens} prompt tokens, not {tokens}")
        self._pending = self._pending[tokens:]
        self.cached_prompt_tokens = tokens

    @property
    def prefilling(self) -> bool:
        """Nothing sampled yet: the prompt (or the rest of it) is still to be fed."""
        return self._counters.generated_tokens == 0

    def peek_input(self, max_tokens: int | None = None) -> np.ndarray:
        """The tokens next_input(max_tokens) would take (int32 (n,)), left pending: a view,
        not to be written, that stays valid after they are taken."""
        n = self.pending_tokens if max_tokens is None else min(max_tokens, self.pending_tokens)
        return self._pending[:n]

    def next_input(self, max_tokens: int | None = None) -> np.ndarray:
        """The next tokens to feed (int32 (n,)), at most ``max_tokens`` of the pending ones.
        When this takes the last pending token, the caller must pass its logits to accept()."""
        taken = self.peek_input(max_tokens)
        self._pending = self._pending[taken.shape[0]:]
        return taken

    def accept(self, logits: np.ndarray) -> list[GenerationEvent | GenerationDone]:
        """Samples a token from ``logits`` (V,) of the last fed token; returns its event, and
        the GenerationDone when the generation ends with it."""
        if self.finished or self.pending_tokens:
            raise RuntimeError("accept() needs the logits of the last pending token of an unfinished generation")
        sampled = self._sampler.sample(logits, self._history[: self._history_len])
        self._counters.token_sampled()
        self._history[self._history_len] = sampled.token_id
        self._history_len += 1

        is_eos = sampled.token_id in self._eos_ids
        text, stopped = self._stop_matcher.push("" if is_eos else self._decoder.push(sampled.token_id))
        finish_reason = _finish_reason(is_eos, stopped, self.generated_tokens, self.session, self.params)
        if finish_reason in ("eos", "length", "context"):
            # Nothing follows: release what was held back for a character or stop string to finish.
            tail, stopped = self._stop_matcher.push(self._decoder.flush())
            text += tail + self._stop_matcher.flush()
            finish_reason = "stop" if stopped else finish_reason
        self._text_parts.append(text)
        event = GenerationEvent(sampled.token_id, text, sampled.logprob, sampled.top_logprobs)
        if finish_reason is None:
            self._pending = np.asarray([sampled.token_id], dtype=np.int32)
            return [event]
        self.finished = True
        return [event, self.done(finish_reason)]

    def done(self, finish_reason: str) -> "GenerationDone":
        """The generation's summary so far, ending for ``finish_reason`` (also for a request
        stopped midway: "cancelled")."""
        counters = self._counters
        return GenerationDone(
            finish_reason=finish_reason,
            prompt_tokens=self.prompt_tokens,
            generated_tokens=counters.generated_tokens,
            time_to_first_token_s=counters.time_to_first_token_s(),
            decode_tokens_per_s=counters.decode_tokens_per_s(),
            text="".join(self._text_parts),
            cached_prompt_tokens=self.cached_prompt_tokens,
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
