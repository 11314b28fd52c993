"""The scheduler against a scripted engine: one generation at a time, in order, stoppable between tokens."""

from __future__ import annotations

import queue
import time
from types import SimpleNamespace

import pytest

from colibrid.engine.expert_cache import ExpertLoadingPaused
from colibrid.engine.experts import ExpertLoadError
from colibrid.engine.generate import GenerationDone, GenerationEvent
from colibrid.protocol import parse_request
from colibrid.scheduler import STOP_CANCELLED, STOP_DISCONNECTED, Job, QueueFull, Scheduler, SchedulerStopped


class ScriptedEngine:
    """Yields one token per prompt character, a few ms apart; records overlapping generations."""

    def __init__(self, token_delay_s: float = 0.002) -> None:
        self.token_delay_s = token_delay_s
        self.loads = 0
        self.experts = SimpleNamespace(summary=lambda: {"hits": 0, "misses": self.loads, "bytes_read": 0})
        self.tokenizer = SimpleNamespace(decode=lambda ids: f"<{ids[0]}>")
        self.active = 0
        self.max_active = 0
        self.started: list[str] = []

    def prompt_ids(self, prompt=None, messages=None, system=None, raw=False, tools=None):
        if prompt == "chat-without-template":
            raise ValueError("this model has no chat template")
        return [ord(c) for c in prompt]

    def generate(self, prompt_ids, params):
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        return self._events(prompt_ids, params)

    def _events(self, prompt_ids, params):
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        self.started.append("".join(map(chr, prompt_ids)))
        try:
            for n in range(params.max_tokens):
                time.sleep(self.token_delay_s)
                if prompt_ids[0] == ord("!"):
                    raise ExpertLoadError("expert 3 of layer 1 fails its checksum", 1, 3, 0, "x")
                if prompt_ids[0] == ord("~"):
                    raise ExpertLoadingPaused("expert 2 of layer 0 is not in the cache and expert loading is "
                                              "paused: the NVMe drive is at 86 °C", "thermal", 0, 2, 0, "x")
                self.loads += 1
                yield GenerationEvent(n, "t", -1.0, [(n, -1.0)])
            yield GenerationDone("length", len(prompt_ids), params.max_tokens, 0.001, 100.0, "t" * params.max_tokens)
        finally:
            self.active -= 1


def ask(request_id, prompt="abc", **fields):
    return parse_request({"op": "ask", "id": request_id, "prompt": prompt, **fields}, default_max_tokens=5)


class Recorder:
    """Collects what a job emits, from the worker thread."""

    def __init__(self) -> None:
        self.events: queue.Queue = queue.Queue()

    def job(self, request) -> Job:
        return Job(request, emit=self.events.put)

    def until_end(self, request_id, timeout_s: float = 10.0) -> tuple[list[dict], dict]:
        tokens = []
        while True:
            event = self.events.get(timeout=timeout_s)
            if event["id"] != request_id:
                continue
            if event["event"] == "token":
                tokens.append(event)
            else:
                return tokens, event


@pytest.fixture
def engine():
    return ScriptedEngine()


@pytest.fixture
def scheduler(engine):
    scheduler = Scheduler(engine, max_queue=4)
    scheduler.start()
    yield scheduler
    scheduler.stop()
    assert scheduler.join(5)


def test_jobs_run_one_at_a_time_in_order(scheduler, engine):
    recorder = Recorder()
    for n in range(5):
        if n == 0:
            scheduler.submit(recorder.job(ask(n, prompt=f"p{n}", max_tokens=20)))
            time.sleep(0.01)  # it is running: the queue holds the next four
        else:
            scheduler.submit(recorder.job(ask(n, prompt=f"p{n}")))
    ends = [recorder.until_end(n)[1] for n in range(5)]
    assert [e["finish_reason"] for e in ends] == ["length"] * 5
    assert engine.max_active == 1
    assert engine.started == [f"p{n}" for n in range(5)]
    assert scheduler.requests_served == 5


def test_a_full_queue_is_refused(engine):
    scheduler = Scheduler(engine, max_queue=2)  # not started: nothing leaves the queue
    recorder = Recorder()
    scheduler.submit(recorder.job(ask(1)))
    scheduler.submit(recorder.job(ask(2)))
    with pytest.raises(QueueFull):
        scheduler.submit(recorder.job(ask(3)))
    assert scheduler.queue_depth == 2


def test_cancel_stops_between_tokens_with_the_text_so_far(scheduler):
    recorder = Recorder()
    job = recorder.job(ask("c", max_tokens=10_000))
    scheduler.submit(job)
    assert recorder.events.get(timeout=5)["event"] == "token"
    assert scheduler.withdraw(job, STOP_CANCELLED) is False  # running: the worker ends it
    tokens, done = recorder.until_end("c")
    assert done["finish_reason"] == "cancelled"
    assert done["usage"]["generated_tokens"] == len(tokens) + 1 < 10_000  # + the one read above
    assert done["text"] == "t" * done["usage"]["generated_tokens"]


def test_a_disconnected_job_ends_silently_and_frees_the_worker(scheduler):
    recorder = Recorder()
    gone = recorder.job(ask("gone", max_tokens=10_000))
    scheduler.submit(gone)
    recorder.events.get(timeout=5)
    scheduler.withdraw(gone, STOP_DISCONNECTED)
    scheduler.submit(recorder.job(ask("next")))
    _, done = recorder.until_end("next", timeout_s=2)
    assert done["event"] == "done"
    remaining = [recorder.events.get_nowait() for _ in range(recorder.events.qsize())]
    assert all(event["id"] != "gone" or event["event"] == "token" for event in remaining)


def test_a_waiting_job_can_be_withdrawn(engine):
    scheduler = Scheduler(engine, max_queue=2)
    job = Recorder().job(ask(1))
    scheduler.submit(job)
    assert scheduler.withdraw(job, STOP_CANCELLED) is True
    assert scheduler.queue_depth == 0


def test_engine_errors_end_only_their_request(scheduler):
    recorder = Recorder()
    scheduler.submit(recorder.job(ask("bad", prompt="!x")))
    scheduler.submit(recorder.job(ask("empty", prompt="")))
    scheduler.submit(recorder.job(ask("chat", prompt="chat-without-template")))
    scheduler.submit(recorder.job(ask("good")))
    assert recorder.until_end("bad")[1]["code"] == "engine"
    assert recorder.until_end("empty")[1]["code"] == "invalid_params"
    assert recorder.until_end("chat")[1]["code"] == "invalid_params"
    assert recorder.until_end("good")[1]["event"] == "done"


def test_a_paused_expert_load_ends_its_request_with_the_pause_code(scheduler):
    """The thermal watch paused loading: the request that needed a read gets `thermal`, the next runs."""
    recorder = Recorder()
    scheduler.submit(recorder.job(ask("hot", prompt="~x")))
    scheduler.submit(recorder.job(ask("cool")))
    error = recorder.until_end("hot")[1]
    assert (error["event"], error["code"]) == ("error", "thermal") and "86 °C" in error["message"]
    assert recorder.until_end("cool")[1]["event"] == "done"


def test_stop_ends_the_running_and_the_waiting_jobs(engine):
    scheduler = Scheduler(engine, max_queue=4)
    scheduler.start()
    recorder = Recorder()
    scheduler.submit(recorder.job(ask("running", max_tokens=10_000)))
    recorder.events.get(timeout=5)
    waiting = recorder.job(ask("waiting"))
    scheduler.submit(waiting)
    assert scheduler.stop() == [waiting]  # the caller ends the waiting ones
    assert recorder.until_end("running")[1]["code"] == "shutdown"
    assert scheduler.join(5)
    with pytest.raises(SchedulerStopped):
        scheduler.submit(recorder.job(ask("late")))


def test_logprobs_carry_the_alternatives_text(scheduler):
    recorder = Recorder()
    scheduler.submit(recorder.job(ask("lp", max_tokens=2, logprobs=1)))
    tokens, _ = recorder.until_end("lp")
    assert tokens[0]["top_logprobs"] == [[0, "<0>", -1.0]] and tokens[0]["logprob"] == -1.0
