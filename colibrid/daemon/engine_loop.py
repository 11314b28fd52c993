"""The engine loop: ONE engine thread that runs the asks as a batch, and the bounded queue that feeds it.

The engine thread takes asks from the head of the queue into the batch, steps the batch, and hands each
ask's tokens and its end back to its connection as typed events (colibrid/wire/events.py); the
connection turns them into frames. It decides little: asks join in order of arrival, as room allows.

Every admitted ask is a sequence of the engine's Batch: each step advances all of them
together (a decode token each, and prompt chunks of those still prefilling), so a routed
expert is read and computed once per layer step for every sequence routed to it. Asks join
when a batch slot is free (max_batch) and their KV cache fits the budget (kv_cache_size);
otherwise they wait in the queue, in order, and beyond max_queue a new ask gets `busy` at once:
a client is better served by an error it can retry than by a wait it cannot see the end of.

The engine is not thread-safe and a step is CPU- and disk-bound, so it runs on its own
thread, never on the event loop: the event loop keeps reading, writing and answering `status`
while the batch decodes. The event loop and the worker share only

  - the queue (a deque under a Condition): the event loop submits and withdraws, the worker takes;
  - Job.stop_reason, which the event loop sets (cancel, disconnect, shutdown) and the worker reads
    at each step boundary, where it takes the sequence out of the batch - so a dead client
    frees its slot and its KV within one step;
  - Job.emit, through which the worker hands each event back; the connection makes it
    loop.call_soon_threadsafe, so the worker never waits for a client, however slow.

Stopping has two steps, so that SIGTERM can drain: close_intake() refuses new asks but lets the
worker finish the running and the waiting ones (it exits when both are empty), and stop()
ends whatever is left with `shutdown`. The worker also stamps the time of its last progress (a
token, a request taken or ended): seconds_without_progress() is the health check behind the
systemd watchdog (a step that only fed prompt chunks is not progress: stall_timeout_s is the
longest wait for a token).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Union

from colibrid.engine.batch import BatchSequence, SequenceFailed, StepFailed
from colibrid.engine.text.chat_template import ChatTemplateError
from colibrid.engine.experts.source import ExpertLoadingPaused
from colibrid.engine.experts.source import ExpertDamagedError, ExpertLoadError
from colibrid.engine.generate import GenerationDone, GenerationEvent
from colibrid.wire.events import DoneEvent, ErrorEvent, TokenEvent, TokenRouting, Usage
from colibrid.wire.requests import Ask
from colibrid.daemon.routing_stream import RoutingStream, token_rows

log = logging.getLogger(__name__)

# What the engine thread hands a job's connection: its tokens, then one done or error.
AskEvent = Union[TokenEvent, DoneEvent, ErrorEvent]

# An idle engine that gets an ask waits this long (from the ask's arrival) for others before
# its first step, unless max_batch asks are already there: asks that come together (xargs -P8,
# a gateway's burst) then share their prompt step. Without it the first ask's prompt runs alone
# and the others, arriving microseconds later, wait through that step and then prefill beside
# its tokens in chunks of prefill_chunk: under a memory limit each such step reads nearly every
# expert again. A lone ask pays these few milliseconds once, when nothing else runs.
BURST_WINDOW_S = 0.005

# Why a job was stopped before its end; set by the event loop, read by the worker.
STOP_CANCELLED = "cancelled"  # a `cancel` request: the job ends with done / finish_reason "cancelled"
STOP_DISCONNECTED = "disconnected"  # the client went away: nothing is sent
STOP_SHUTDOWN = "shutdown"  # the daemon is stopping: the job ends with a `shutdown` error


class QueueFull(Exception):
    """max_queue asks already wait."""


class IntakeClosed(Exception):
    """The loop takes no new asks: the daemon is draining or stopping."""


@dataclass(eq=False)
class Job:
    """One ask on its way through the engine loop."""

    ask: Ask
    emit: Callable[[AskEvent], None]  # thread-safe: hands one event back to the connection
    stop_reason: str | None = None
    submitted_s: float = field(default_factory=time.monotonic)
    origin: str = "a client"  # who asked, for the log: "connection 3 (uid 1000 (alice) gid 1000 pid 42)"
    prefix_scope: bytes = b""  # who asked, for prefix reuse: asks reuse only what asks of the same scope left
    # Set by the worker when it first looks at the job at the head of the queue:
    prepared: "tuple | None" = None  # (Generation, Session) ready to join the batch
    sequence: BatchSequence | None = None  # while it runs


def shutdown_error(job: Job) -> ErrorEvent:
    return ErrorEvent(job.ask.id, "shutdown", "colibrid is stopping; the request was not completed")


def cancelled_done(job: Job) -> DoneEvent:
    """The `done` of a job cancelled while it still waited in the queue: nothing was generated."""
    return DoneEvent(job.ask.id, "cancelled", "", Usage())


def done_event(job: Job, done: GenerationDone, sequence: BatchSequence) -> DoneEvent:
    """The `done` ending a job: the engine's GenerationDone (finish_reason, text and counts) and
    the expert cache's hits and misses in the steps the job's sequence took part in."""
    return DoneEvent(job.ask.id, done.finish_reason, done.text, Usage(
        prompt_tokens=done.prompt_tokens, cached_prompt_tokens=done.cached_prompt_tokens,
        generated_tokens=done.generated_tokens, time_to_first_token_ms=done.time_to_first_token_s * 1000.0,
        decode_tokens_per_s=done.decode_tokens_per_s, expert_cache_hits=sequence.expert_hits,
        expert_cache_misses=sequence.expert_misses))


class EngineLoop:
    """The engine thread and its queue of asks. The event loop submits, withdraws and reads
    counters (the "called from the event loop" methods); everything else runs on the thread."""

    def __init__(self, engine, max_queue: int, max_batch: int = 8, prefill_chunk: int = 512,
                 kv_budget_bytes: int = 1 << 30, prefix_cache_bytes: int = 0,
                 burst_window_s: float = BURST_WINDOW_S) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.burst_window_s = burst_window_s
        # touched by the worker only (status reads its counters)
        self.batch = engine.new_batch(max_batch, prefill_chunk, kv_budget_bytes, prefix_cache_bytes)
        # The routing stream's subscribers (the server's) and debug_routing asks: what each step's router chose
        self.routing = RoutingStream(engine.model.routing_capture, lambda: engine.experts.layer_counters())
        self.requests_served = 0  # asks that ended with `done`, whatever the finish reason
        self.tokens_generated = 0  # tokens streamed since start, for the recent tokens/s in STATUS=
        self._cond = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []  # replaced, never changed in place: the event loop may read it any time
        self._between_steps: collections.deque[Callable[[], None]] = collections.deque()
        self._intake_closed = False  # no new asks; the worker exits once nothing runs or waits
        self._stopped = False  # the worker exits after its current step
        self._last_progress_s = time.monotonic()  # written by the worker, read by the event loop: one float
        self._thread = threading.Thread(target=self._work, name="colibrid-engine", daemon=True)

    # -- called from the event loop -------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def requests_running(self) -> int:
        return len(self._running)

    def running_status(self) -> list[dict]:
        """For `status`: each running request's id, peer, phase, tokens so far and tok/s."""
        return [{"id": job.ask.id, "peer": job.origin, "phase": job.sequence.phase,
                 "tokens": job.sequence.generation.generated_tokens,
                 "tokens_per_s": job.sequence.tokens_per_s()}
                for job in self._running if job.sequence is not None]

    def batch_status(self) -> dict:
        return self.batch.status()

    def kv_status(self) -> dict:
        return self.batch.kv_status()

    def prefix_cache_status(self) -> dict:
        return self.batch.prefix_cache_status()

    def seconds_without_progress(self) -> float:
        """How long the running batch has gone without a step (0 when nothing runs)."""
        if not self._running:
            return 0.0
        return max(0.0, time.monotonic() - self._last_progress_s)

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopped or self._intake_closed:
                raise IntakeClosed()
            if len(self._waiting) >= self.max_queue:
                raise QueueFull()
            self._waiting.append(job)
            self._cond.notify()

    def withdraw(self, job: Job, reason: str) -> bool:
        """Stop `job`. True if it was still waiting (removed; the caller ends it), False if the
        worker will (at the next step boundary)."""
        with self._cond:
            job.stop_reason = reason
            try:
                self._waiting.remove(job)
            except ValueError:
                return False
            return True

    def run_between_steps(self, task: Callable[[], None]) -> None:
        """Run ``task`` on the engine thread before the next step (at once when idle): for
        changes a step must never see half-way, such as swapping the expert cache."""
        with self._cond:
            self._between_steps.append(task)
            self._cond.notify()

    def close_intake(self) -> None:
        """Accept no new asks; the running and waiting ones go on, and the worker exits after the last."""
        with self._cond:
            self._intake_closed = True
            self._cond.notify_all()

    def stop(self) -> list[Job]:
        """Accept nothing more; flag the running jobs; return the waiting ones for the caller to end."""
        with self._cond:
            self._stopped = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            for job in self._running + waiting:
                job.stop_reason = STOP_SHUTDOWN
            self._cond.notify_all()
        return waiting

    @property
    def finished(self) -> bool:
        """The engine thread has exited (or never started): nothing uses the engine any more."""
        return not self._thread.is_alive()

    def join(self, timeout_s: float) -> bool:
        """Wait for the worker to finish its current step; False if it did not within timeout_s."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # -- the worker thread -----------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self._running or self._between_steps or self._stopped
                           or self._intake_closed):
                    self._cond.wait()
                self._wait_for_a_burst()
                tasks = list(self._between_steps)
                self._between_steps.clear()
                stopped = self._stopped
                drained = self._intake_closed and not self._waiting and not self._running
            if tasks:
                self._run_tasks(tasks)
            self._retire_stopped()
            if stopped or (drained and not tasks):
                return
            self._admit()
            if self._running:
                self._step()

    def _wait_for_a_burst(self) -> None:
        """With the lock held: when nothing runs and asks wait, gives the asks that arrive with
        the first up to burst_window_s after it to join it (see BURST_WINDOW_S)."""
        if self._running or not self._waiting:
            return
        deadline = self._waiting[0].submitted_s + self.burst_window_s
        while (len(self._waiting) < self.batch.max_batch and not (self._between_steps or self._stopped
                                                                  or self._intake_closed)):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(left)

    def _admit(self) -> None:
        """Moves asks from the head of the queue into the batch while a slot is free and their
        KV fits; an ask that cannot fit even alone, or whose prompt is bad, ends with an error."""
        while True:
            with self._cond:
                if not self._waiting or len(self._running) >= self.batch.max_batch:
                    return
                job = self._waiting[0]
            if job.prepared is None:
                error = self._prepare(job)
                if error is not None:
                    if self._take_from_queue(job):
                        self._finish(job, error)
                    continue
            generation, session = job.prepared
            if not self.batch.has_room(session.state.nbytes):
                return  # it waits for a sequence to end and free its KV; the order is kept
            if not self._take_from_queue(job):
                continue  # withdrawn meanwhile: the event loop has ended it
            job.sequence = self.batch.admit(job, generation, session, job.prefix_scope)
            with self._cond:
                self._running = self._running + [job]
            self._last_progress_s = time.monotonic()
            log.debug("request %r from %s: %d prompt tokens, waited %.3f s, batch of %d", job.ask.id, job.origin,
                      generation.prompt_tokens, time.monotonic() - job.submitted_s, len(self._running))

    def _take_from_queue(self, job: Job) -> bool:
        with self._cond:
            if self._waiting and self._waiting[0] is job:
                self._waiting.popleft()
                return True
            return False

    def _prepare(self, job: Job) -> ErrorEvent | None:
        """Tokenizes the ask and builds its generation and state (sets job.prepared); the
        error event that ends it instead, if any."""
        ask = job.ask
        try:
            prompt_ids = self.engine.prompt_ids(prompt=ask.prompt, messages=ask.messages, system=ask.system,
                                                raw=ask.raw, tools=ask.tools)
            generation, session = self.engine.start_generation(prompt_ids, ask.params,
                                                               resumable=self.batch.keeps_prefixes)
            self.batch.check_fits_alone(session.state.nbytes)
        except ChatTemplateError as exc:  # the pack's template went over its budget: the model's fault
            log.warning("request %r from %s: %s", ask.id, job.origin, exc)
            return ErrorEvent(ask.id, "engine", str(exc))
        except ValueError as exc:  # an empty or too long prompt, a chat without a template, too much KV
            return ErrorEvent(ask.id, "invalid_params", str(exc))
        except Exception:  # the worker must survive any one request
            log.exception("request %r from %s could not start", ask.id, job.origin)
            return ErrorEvent(ask.id, "engine", "internal error; see the daemon log")
        job.prepared = (generation, session)
        return None

    def _step(self) -> None:
        self.routing.before_step(debug_asks=any(job.ask.debug_routing for job in self._running))
        try:
            results = self.batch.step()
        except StepFailed as failure:
            self._fail(failure.sequences, failure.__cause__)
            return
        routing = self.routing.after_step(self.batch.steps)  # None unless someone watches
        if any(outcomes for _, outcomes in results):  # a token (a prompt chunk alone is not one: stall_timeout_s)
            self._last_progress_s = time.monotonic()
        for index, (sequence, outcomes) in enumerate(results):  # in the step's order: sequence `index` of it
            debug = routing is not None and sequence.key.ask.debug_routing and token_rows(routing, index)
            self._deliver(sequence.key, sequence, outcomes,
                          TokenRouting(self.batch.steps, routing.layers, *debug) if debug else None)

    def _fail(self, sequences: list[BatchSequence], cause: BaseException | None) -> None:
        """A step failed: its sequences had their states partly advanced, so they all end with
        the error; the batch's other sequences (prompts waiting for their chunk) go on."""
        damage = None
        if isinstance(cause, ExpertLoadingPaused):  # the drive is too hot or gone: these requests only, by design
            code, message, level = cause.code, str(cause), logging.WARNING
        elif isinstance(cause, ExpertDamagedError):  # a damaged record of the pack, known or just found
            code, message, level, damage = "pack_damaged", str(cause), logging.ERROR, cause.record.to_json()
        elif isinstance(cause, ExpertLoadError):
            code, message, level = "engine", str(cause), logging.ERROR
        else:  # the worker must survive any one step
            log.error("a step of %d requests failed unexpectedly", len(sequences), exc_info=cause)
            code, message, level = "engine", "internal error; see the daemon log", None
        for sequence in sequences:
            job = sequence.key
            if level is not None:
                log.log(level, "request %r from %s: %s", job.ask.id, job.origin, message)
            self._finish(job, ErrorEvent(job.ask.id, code, message, damage))

    def _deliver(self, job: Job, sequence: BatchSequence, outcomes: list,
                 routing: TokenRouting | None = None) -> None:
        for outcome in outcomes:
            if isinstance(outcome, SequenceFailed):
                log.error("request %r from %s: %s", job.ask.id, job.origin, outcome.message)
                self._finish(job, ErrorEvent(job.ask.id, outcome.code, outcome.message, outcome.damage))
            elif isinstance(outcome, GenerationDone):
                self._finish(job, done_event(job, outcome, sequence))
            elif job.stop_reason is None:  # a stopped job gets nothing more; _retire_stopped ends it
                self.tokens_generated += 1
                job.emit(self._token_event(job, outcome, routing))

    def _token_event(self, job: Job, token: GenerationEvent, routing: TokenRouting | None) -> TokenEvent:
        """A sampled token (the engine's GenerationEvent) as its `token` event. With logprobs
        asked for, its logprob and its alternatives as [id, text, logprob]: the texts are decoded
        here, on the engine thread, which owns the tokenizer."""
        if job.ask.params.logprobs is None:
            return TokenEvent(job.ask.id, [token.token_id], token.text, routing=routing)
        alternatives = [[token_id, self.engine.tokenizer.decode([token_id]), logprob]
                        for token_id, logprob in (token.top_logprobs or [])]
        return TokenEvent(job.ask.id, [token.token_id], token.text, token.logprob, alternatives, routing)

    def _retire_stopped(self) -> None:
        """Takes the cancelled, disconnected and shut-down sequences out of the batch."""
        for job in list(self._running):
            if job.stop_reason is None:
                continue
            sequence = self.batch.remove(job)
            log.debug("request %r from %s stopped (%s)", job.ask.id, job.origin, job.stop_reason)
            if job.stop_reason == STOP_CANCELLED and sequence is not None:
                self._finish(job, done_event(job, sequence.generation.done("cancelled"), sequence))
            elif job.stop_reason == STOP_SHUTDOWN:
                self._finish(job, shutdown_error(job))
            else:
                self._finish(job, None)  # disconnected: nobody to tell

    def _finish(self, job: Job, last_event: DoneEvent | ErrorEvent | None) -> None:
        # The job stops counting as running before its last event leaves, so a client that
        # asks for `status` right after `done` never sees its own request still running.
        with self._cond:
            if job in self._running:
                self._running = [other for other in self._running if other is not job]
            self._last_progress_s = time.monotonic()
            if isinstance(last_event, DoneEvent):
                self.requests_served += 1
        if last_event is not None:
            job.emit(last_event)
        self._log_finished(job, last_event)

    @staticmethod
    def _log_finished(job: Job, last_event: DoneEvent | ErrorEvent | None) -> None:
        """One info line per request the engine took: who asked, how much, how fast, how it ended."""
        if isinstance(last_event, DoneEvent):
            usage = last_event.usage
            ending = last_event.finish_reason
            prompt_tokens, generated_tokens = usage.prompt_tokens, usage.generated_tokens
            tokens_per_s = usage.decode_tokens_per_s
        else:  # an error, or a client that went away: what it had produced until then
            ending = f"error {last_event.code}" if last_event is not None else str(job.stop_reason)
            generation = job.sequence.generation if job.sequence is not None else None
            prompt_tokens = generation.prompt_tokens if generation is not None else 0
            generated_tokens = generation.generated_tokens if generation is not None else 0
            tokens_per_s = generation.decode_tokens_per_s if generation is not None else 0.0
        log.info("request %r from %s: %d prompt tokens, %d generated, %.1f tokens/s, %s", job.ask.id, job.origin,
                 prompt_tokens, generated_tokens, tokens_per_s, ending)

    @staticmethod
    def _run_tasks(tasks: list[Callable[[], None]]) -> None:
        for task in tasks:
            try:
                task()
            except Exception:  # the worker must survive a failed task as it survives a failed request
                log.exception("engine-thread task %r failed", task)
