"""The scheduler: a bounded queue of asks and ONE engine thread that runs them one at a time.

The engine is not thread-safe and a generation is CPU- and disk-bound, so it runs on its own
thread, never on the event loop: the loop keeps reading, writing and answering `status` while
a request decodes. The loop and the worker share only

  - the queue (a deque under a Condition): the loop submits and withdraws, the worker takes;
  - Job.stop_reason, which the loop sets (cancel, disconnect, shutdown) and the worker reads
    between tokens - closing the generator there, so a dead client frees its place within one
    token;
  - Job.emit, through which the worker hands each event back; the server makes it
    loop.call_soon_threadsafe, so the worker never waits for a client, however slow.

A full queue is refused at once (`busy`): a client is better served by an error it can retry
than by a wait it cannot see the end of.

Stopping has two steps, so that SIGTERM can drain: close_intake() refuses new asks but lets the
worker finish the running and the waiting ones (it exits when the queue is empty), and stop()
ends whatever is left with `shutdown`. The worker also stamps the time of its last progress (a
request taken, a token produced, a request ended): seconds_without_progress() is the health
check behind the systemd watchdog.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from colibrid.engine.chat_template import ChatTemplateError
from colibrid.engine.expert_cache import ExpertLoadingPaused
from colibrid.engine.experts import ExpertLoadError
from colibrid.engine.generate import GenerationDone, GenerationEvent
from colibrid.protocol import Ask, error_event

log = logging.getLogger(__name__)

Event = dict[str, Any]

# Why a job was stopped before its end; set by the event loop, read by the worker.
STOP_CANCELLED = "cancelled"  # a `cancel` request: the job ends with done / finish_reason "cancelled"
STOP_DISCONNECTED = "disconnected"  # the client went away: nothing is sent
STOP_SHUTDOWN = "shutdown"  # the daemon is stopping: the job ends with a `shutdown` error


class QueueFull(Exception):
    pass


class SchedulerStopped(Exception):
    pass


@dataclass(eq=False)
class Job:
    """One ask on its way through the scheduler."""

    ask: Ask
    emit: Callable[[Event], None]  # thread-safe: hands one event back to the connection
    stop_reason: str | None = None
    submitted_s: float = field(default_factory=time.monotonic)
    origin: str = "a client"  # who asked, for the log: "connection 3 (uid 1000 (alice) gid 1000 pid 42)"
    progress: "_Progress | None" = None  # set by the worker when the generation starts


def shutdown_error(job: Job) -> Event:
    return error_event(job.ask.id, "shutdown", "colibrid is stopping; the request was not completed")


def cancelled_done(job: Job, text: str = "", prompt_tokens: int = 0, generated_tokens: int = 0,
                   time_to_first_token_ms: float = 0.0, decode_tokens_per_s: float = 0.0,
                   expert_hits: int = 0, expert_misses: int = 0) -> Event:
    return done_event(job, "cancelled", text, prompt_tokens, generated_tokens, time_to_first_token_ms,
                      decode_tokens_per_s, expert_hits, expert_misses)


def done_event(job: Job, finish_reason: str, text: str, prompt_tokens: int, generated_tokens: int,
               time_to_first_token_ms: float, decode_tokens_per_s: float, expert_hits: int,
               expert_misses: int) -> Event:
    return {
        "event": "done", "id": job.ask.id, "finish_reason": finish_reason, "text": text,
        "usage": {
            "prompt_tokens": prompt_tokens, "generated_tokens": generated_tokens,
            "time_to_first_token_ms": time_to_first_token_ms, "decode_tokens_per_s": decode_tokens_per_s,
            "expert_cache_hits": expert_hits, "expert_cache_misses": expert_misses,
        },
    }


def expert_counts(source) -> tuple[int, int]:
    """(hits, misses) of an expert source so far (ExpertSource.summary)."""
    summary = source.summary()
    return summary["hits"], summary["misses"]


class Scheduler:
    def __init__(self, engine, max_queue: int) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.requests_served = 0  # asks that ended with `done`, whatever the finish reason
        self.tokens_generated = 0  # tokens streamed since start, for the recent tokens/s in STATUS=
        self._cond = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: Job | None = None
        self._between_requests: collections.deque[Callable[[], None]] = collections.deque()
        self._intake_closed = False  # no new asks; the worker exits once the queue is empty
        self._stopped = False  # the worker exits after its current token
        self._last_progress_s = time.monotonic()  # written by the worker, read by the loop: one float
        self._thread = threading.Thread(target=self._work, name="colibrid-engine", daemon=True)

    # -- called from the event loop -------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def requests_running(self) -> int:
        return 0 if self._running is None else 1

    def seconds_without_progress(self) -> float:
        """How long the running request has gone without a token (0 when nothing runs)."""
        if self._running is None:
            return 0.0
        return max(0.0, time.monotonic() - self._last_progress_s)

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopped or self._intake_closed:
                raise SchedulerStopped()
            if len(self._waiting) >= self.max_queue:
                raise QueueFull()
            self._waiting.append(job)
            self._cond.notify()

    def withdraw(self, job: Job, reason: str) -> bool:
        """Stop `job`. True if it was still waiting (removed; the caller ends it), False if the worker will."""
        with self._cond:
            job.stop_reason = reason
            try:
                self._waiting.remove(job)
            except ValueError:
                return False
            return True

    def run_between_requests(self, task: Callable[[], None]) -> None:
        """Run ``task`` on the engine thread before the next request starts (at once when idle):
        for changes a generation must never see half-way, such as swapping the expert cache."""
        with self._cond:
            self._between_requests.append(task)
            self._cond.notify()

    def close_intake(self) -> None:
        """Accept no new asks; the running and waiting ones go on, and the worker exits after the last."""
        with self._cond:
            self._intake_closed = True
            self._cond.notify_all()

    def stop(self) -> list[Job]:
        """Accept nothing more; flag the running job; return the waiting ones for the caller to end."""
        with self._cond:
            self._stopped = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            if self._running is not None:
                self._running.stop_reason = STOP_SHUTDOWN
            for job in waiting:
                job.stop_reason = STOP_SHUTDOWN
            self._cond.notify_all()
        return waiting

    @property
    def finished(self) -> bool:
        """The engine thread has exited (or never started): nothing uses the engine any more."""
        return not self._thread.is_alive()

    def join(self, timeout_s: float) -> bool:
        """Wait for the worker to finish its current token; False if it did not within timeout_s."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # -- the worker thread -----------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self._between_requests or self._stopped or self._intake_closed):
                    self._cond.wait()
                tasks = list(self._between_requests)
                self._between_requests.clear()
                if not tasks:
                    if self._stopped or not self._waiting:
                        return  # stopped, or drained after close_intake()
                    job = self._running = self._waiting.popleft()
                    self._last_progress_s = time.monotonic()
            if tasks:
                self._run_tasks(tasks)
                continue
            try:
                last_event = self._run(job)
            except Exception:  # the worker must survive any one request
                log.exception("request %r from %s failed unexpectedly", job.ask.id, job.origin)
                last_event = error_event(job.ask.id, "engine", "internal error; see the daemon log")
            # The job stops counting as running before its last event leaves, so a client that
            # asks for `status` right after `done` never sees its own request still running.
            with self._cond:
                self._running = None
                self._last_progress_s = time.monotonic()
                if last_event is not None and last_event["event"] == "done":
                    self.requests_served += 1
            if last_event is not None:
                job.emit(last_event)
            self._log_finished(job, last_event)

    @staticmethod
    def _log_finished(job: Job, last_event: Event | None) -> None:
        """One info line per request the engine took: who asked, how much, how fast, how it ended."""
        if last_event is not None and last_event["event"] == "done":
            usage = last_event["usage"]
            ending = last_event["finish_reason"]
            prompt_tokens, generated_tokens = usage["prompt_tokens"], usage["generated_tokens"]
            tokens_per_s = usage["decode_tokens_per_s"]
        else:  # an error, or a client that went away: what it had produced until then
            ending = f"error {last_event['code']}" if last_event is not None else str(job.stop_reason)
            progress = job.progress or _Progress(0.0)
            prompt_tokens, generated_tokens = progress.prompt_tokens, progress.generated_tokens
            tokens_per_s = progress.decode_tokens_per_s()
        log.info("request %r from %s: %d prompt tokens, %d generated, %.1f tokens/s, %s", job.ask.id, job.origin,
                 prompt_tokens, generated_tokens, tokens_per_s, ending)

    @staticmethod
    def _run_tasks(tasks: list[Callable[[], None]]) -> None:
        for task in tasks:
            try:
                task()
            except Exception:  # the worker must survive a failed task as it survives a failed request
                log.exception("engine-thread task %r failed", task)

    def _run(self, job: Job) -> Event | None:
        """Stream the job's tokens; return its last event (done or error), None if nobody is listening."""
        if job.stop_reason is not None:  # stopped between being taken and starting
            return self._stopped_event(job, _Progress(time.perf_counter()))
        ask = job.ask
        try:
            prompt_ids = self.engine.prompt_ids(prompt=ask.prompt, messages=ask.messages, system=ask.system,
                                                raw=ask.raw, tools=ask.tools)
            events = self.engine.generate(prompt_ids, ask.params)
        except ChatTemplateError as exc:  # the pack's template went over its budget: the model's fault
            log.warning("request %r from %s: %s", ask.id, job.origin, exc)
            return error_event(ask.id, "engine", str(exc))
        except ValueError as exc:  # an empty or too long prompt, a chat without a template
            return error_event(ask.id, "invalid_params", str(exc))
        progress = job.progress = _Progress(time.perf_counter(), prompt_tokens=len(prompt_ids),
                                            expert_counts_before=expert_counts(self.engine.experts))
        log.debug("request %r from %s: %d prompt tokens, waited %.3f s", ask.id, job.origin, len(prompt_ids),
                  time.monotonic() - job.submitted_s)
        try:
            return self._stream(job, events, progress)
        except ExpertLoadingPaused as exc:  # the drive is too hot or gone: this request only, by design
            log.warning("request %r from %s: %s", ask.id, job.origin, exc)
            return error_event(ask.id, exc.code, str(exc))
        except ExpertLoadError as exc:
            log.error("request %r from %s: %s", ask.id, job.origin, exc)
            return error_event(ask.id, "engine", str(exc))
        finally:
            events.close()  # between tokens: nothing is left half-done

    def _stream(self, job: Job, events: Iterator[GenerationEvent | GenerationDone],
                progress: "_Progress") -> Event | None:
        for event in events:
            if job.stop_reason is not None:
                return self._stopped_event(job, progress)
            if isinstance(event, GenerationDone):
                return done_event(job, event.finish_reason, event.text, event.prompt_tokens, event.generated_tokens,
                                  event.time_to_first_token_s * 1000.0, event.decode_tokens_per_s,
                                  *self._expert_counts_since(progress))
            progress.token(event.text)
            self.tokens_generated += 1
            self._last_progress_s = time.monotonic()
            job.emit(self._token_event(job, event))
        raise RuntimeError("the generation ended without GenerationDone")

    def _token_event(self, job: Job, event: GenerationEvent) -> Event:
        token: Event = {"event": "token", "id": job.ask.id, "token_ids": [event.token_id], "text": event.text}
        if job.ask.params.logprobs is not None:
            decode = self.engine.tokenizer.decode
            token["logprob"] = event.logprob
            token["top_logprobs"] = [[token_id, decode([token_id]), logprob]
                                     for token_id, logprob in (event.top_logprobs or [])]
        return token

    def _stopped_event(self, job: Job, progress: "_Progress") -> Event | None:
        log.debug("request %r from %s stopped (%s) after %d tokens", job.ask.id, job.origin, job.stop_reason,
                  progress.generated_tokens)
        if job.stop_reason == STOP_CANCELLED:
            return cancelled_done(job, "".join(progress.text_parts), progress.prompt_tokens,
                                  progress.generated_tokens, progress.time_to_first_token_ms(),
                                  progress.decode_tokens_per_s(), *self._expert_counts_since(progress))
        if job.stop_reason == STOP_SHUTDOWN:
            return shutdown_error(job)
        return None  # disconnected: nobody to tell

    def _expert_counts_since(self, progress: "_Progress") -> tuple[int, int]:
        """(hits, misses) during this request: only the worker runs the engine, so the difference is its own."""
        hits, misses = expert_counts(self.engine.experts)
        return hits - progress.expert_counts_before[0], misses - progress.expert_counts_before[1]


@dataclass
class _Progress:
    """What a request has produced so far, for the `done` of a request stopped midway."""

    start_s: float
    prompt_tokens: int = 0
    expert_counts_before: tuple[int, int] = (0, 0)  # (hits, misses) when the request started
    generated_tokens: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None
    text_parts: list[str] = field(default_factory=list)

    def token(self, text: str) -> None:
        now = time.perf_counter()
        self.first_token_s = now if self.first_token_s is None else self.first_token_s
        self.last_token_s = now
        self.generated_tokens += 1
        self.text_parts.append(text)

    def time_to_first_token_ms(self) -> float:
        return 0.0 if self.first_token_s is None else (self.first_token_s - self.start_s) * 1000.0

    def decode_tokens_per_s(self) -> float:
        if self.generated_tokens < 2 or self.first_token_s is None or self.last_token_s is None:
            return 0.0
        elapsed_s = self.last_token_s - self.first_token_s
        return (self.generated_tokens - 1) / elapsed_s if elapsed_s > 0 else 0.0
