"""The engine loop on a real engine (the demo pack): asks run together in one batch, join and
leave between steps, stop at a step boundary, wait for KV memory, and fail alone."""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Iterator

import pytest

from colibrid.engine.engine import Engine
from colibrid.engine.experts.source import ExpertLoadingPaused
from colibrid.engine.experts.source import ExpertLoadError
from colibrid.wire.events import DoneEvent, ErrorEvent, TokenEvent
from colibrid.wire.requests import parse_request
from colibrid.daemon.engine_loop import STOP_CANCELLED, STOP_DISCONNECTED, EngineLoop, IntakeClosed, Job, QueueFull

BIG_BUDGET = 1 << 34


class FaultyEngine(Engine):
    """The demo engine, with faults scripted by the prompt: "!" an expert that fails its
    checksum, "~" loading paused by the thermal watch, "chat-without-template" a ValueError;
    and a record of how many sequences each step carried."""

    def __init__(self, *args, step_delay_s: float = 0.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.step_sizes: list[int] = []
        self.step_delay_s = step_delay_s
        self._faults: dict[int, Exception] = {}  # id(state) -> what its steps raise
        self._next_fault: Exception | None = None
        forward_batch = self.model.forward_batch

        def faulty_forward_batch(inputs):
            self.step_sizes.append(len(inputs))
            time.sleep(self.step_delay_s)
            for item in inputs:
                if id(item.state) in self._faults:
                    raise self._faults[id(item.state)]
            return forward_batch(inputs)

        self.model.forward_batch = faulty_forward_batch

    def prompt_ids(self, prompt=None, messages=None, system=None, raw=False, tools=None):
        if prompt == "chat-without-template":
            raise ValueError("this model has no chat template")
        self._next_fault = {"!": ExpertLoadError("expert 3 of layer 1 fails its checksum", 1, 3, 0, "x"),
                            "~": ExpertLoadingPaused("expert 2 of layer 0 is not in the cache and expert loading is "
                                                     "paused: the NVMe drive is at 86 °C", "thermal", 0, 2, 0, "x"),
                            }.get(prompt[:1])
        return [ord(c) % self.config.vocab_size for c in prompt]

    def start_generation(self, prompt_ids, params, **options):
        generation, session = super().start_generation(prompt_ids, params, **options)
        if self._next_fault is not None:
            self._faults[id(session.state)] = self._next_fault
        return generation, session


def ask(request_id, prompt="abc", **fields):
    return parse_request({"op": "ask", "id": request_id, "prompt": prompt, "temperature": 0.0, "ignore_eos": True,
                          **fields}, default_max_tokens=5)


class Recorder:
    """Collects what jobs emit, from the worker thread, sorted by request: each event as the map
    its connection would send (to_wire)."""

    def __init__(self) -> None:
        self.events: queue.Queue = queue.Queue()
        self._by_id: dict = {}

    def job(self, request) -> Job:
        return Job(request, emit=self._record)

    def _record(self, event) -> None:
        assert isinstance(event, (TokenEvent, DoneEvent, ErrorEvent)), event  # typed values, not maps
        self.events.put(event.to_wire())

    def until_end(self, request_id, timeout_s: float = 20.0) -> tuple[list[dict], dict]:
        """The request's token events and its last event, in the order they came."""
        mine = self._by_id.setdefault(request_id, [])
        while not mine or mine[-1]["event"] == "token":
            event = self.events.get(timeout=timeout_s)
            self._by_id.setdefault(event["id"], []).append(event)
        return mine[:-1], mine[-1]


@pytest.fixture(scope="module")
def pack(demo_pack):
    from colibrid.pack.reader import Pack

    return Pack.open(demo_pack)


@pytest.fixture
def engine(pack):
    return FaultyEngine(pack)


def started(engine, max_queue=8, **kwargs) -> EngineLoop:
    engine_loop = EngineLoop(engine, max_queue=max_queue, **{"kv_budget_bytes": BIG_BUDGET, **kwargs})
    engine_loop.start()
    return engine_loop


@contextlib.contextmanager
def running(engine, **kwargs) -> Iterator[EngineLoop]:
    """A started engine loop, stopped and joined when the block ends."""
    engine_loop = started(engine, **kwargs)
    try:
        yield engine_loop
    finally:
        engine_loop.stop()
        assert engine_loop.join(10)


@pytest.fixture
def engine_loop(engine):
    with running(engine) as engine_loop:
        yield engine_loop


def test_asks_run_together_and_each_gets_what_it_would_alone(engine_loop, engine, pack):
    recorder = Recorder()
    prompts = [f"prompt number {n}" * (n + 1) for n in range(6)]
    for n, prompt in enumerate(prompts):
        engine_loop.submit(recorder.job(ask(n, prompt=prompt, max_tokens=4 + n)))
    ends = {n: recorder.until_end(n) for n in range(6)}
    assert max(engine.step_sizes) > 1  # they shared steps
    alone = FaultyEngine(pack)
    for n, prompt in enumerate(prompts):
        tokens, done = ends[n]
        params = ask(n, prompt=prompt, max_tokens=4 + n).params
        expected = [e.token_id for e in list(alone.generate(alone.prompt_ids(prompt=prompt), params))[:-1]]
        assert [t["token_ids"][0] for t in tokens] == expected and done["finish_reason"] == "length"
    assert engine_loop.requests_served == 6


@pytest.mark.parametrize("window_s", [0.0, 1.0])
def test_an_idle_engine_gives_asks_arriving_together_one_first_step(engine, window_s):
    """Asks 0.2 s apart: inside the burst window they share their first (prompt) step; with no
    window the first one's prompt runs alone and the rest wait through it."""
    with running(engine, burst_window_s=window_s) as engine_loop:
        recorder = Recorder()
        engine_loop.submit(recorder.job(ask(0, prompt="first")))
        time.sleep(0.2)
        for n in range(1, 4):
            engine_loop.submit(recorder.job(ask(n, prompt=f"then {n}")))
        assert [recorder.until_end(n)[1]["finish_reason"] for n in range(4)] == ["length"] * 4
    assert engine.step_sizes[0] == (4 if window_s else 1)


def test_a_full_batch_does_not_wait_for_the_burst_window(engine):
    with running(engine, max_batch=2, burst_window_s=60.0) as engine_loop:
        recorder = Recorder()
        for n in range(2):
            engine_loop.submit(recorder.job(ask(n)))
        assert [recorder.until_end(n, timeout_s=20)[1]["finish_reason"] for n in range(2)] == ["length"] * 2
    assert engine.step_sizes[0] == 2


def test_a_full_queue_is_refused(engine):
    engine_loop = EngineLoop(engine, max_queue=2)  # not started: nothing leaves the queue
    recorder = Recorder()
    engine_loop.submit(recorder.job(ask(1)))
    engine_loop.submit(recorder.job(ask(2)))
    with pytest.raises(QueueFull):
        engine_loop.submit(recorder.job(ask(3)))
    assert engine_loop.queue_depth == 2


def test_asks_beyond_max_batch_wait_and_join_as_others_leave(engine):
    with running(engine, max_batch=2) as engine_loop:
        recorder = Recorder()
        for n in range(5):
            engine_loop.submit(recorder.job(ask(n, prompt=f"p{n}", max_tokens=3 + 2 * n)))
        assert [recorder.until_end(n)[1]["finish_reason"] for n in range(5)] == ["length"] * 5
        assert max(engine.step_sizes) == 2


def test_cancel_frees_the_slot_at_the_next_step_with_the_text_so_far(engine):
    engine.step_delay_s = 0.002
    with running(engine, max_batch=1) as engine_loop:
        recorder = Recorder()
        job = recorder.job(ask("c", max_tokens=10_000))
        engine_loop.submit(job)
        engine_loop.submit(recorder.job(ask("next", max_tokens=3)))
        assert recorder.events.get(timeout=10)["event"] == "token"
        assert engine_loop.withdraw(job, STOP_CANCELLED) is False  # running: the worker ends it
        tokens, done = recorder.until_end("c")
        assert done["finish_reason"] == "cancelled"
        assert len(tokens) + 1 <= done["usage"]["generated_tokens"] < 10_000  # + the one read above
        assert recorder.until_end("next")[1]["finish_reason"] == "length"  # the slot was freed


def test_a_disconnected_job_ends_silently_and_frees_its_slot(engine):
    engine.step_delay_s = 0.002
    with running(engine, max_batch=1) as engine_loop:
        recorder = Recorder()
        gone = recorder.job(ask("gone", max_tokens=10_000))
        engine_loop.submit(gone)
        recorder.events.get(timeout=10)
        engine_loop.withdraw(gone, STOP_DISCONNECTED)
        engine_loop.submit(recorder.job(ask("next")))
        _, done = recorder.until_end("next", timeout_s=10)
        assert done["event"] == "done"
        remaining = [recorder.events.get_nowait() for _ in range(recorder.events.qsize())]
        assert all(event["id"] != "gone" or event["event"] == "token" for event in remaining)
        assert engine_loop.requests_running == 0


def test_a_waiting_job_can_be_withdrawn(engine):
    engine_loop = EngineLoop(engine, max_queue=2)
    job = Recorder().job(ask(1))
    engine_loop.submit(job)
    assert engine_loop.withdraw(job, STOP_CANCELLED) is True
    assert engine_loop.queue_depth == 0


def test_bad_asks_end_only_themselves(engine_loop):
    recorder = Recorder()
    engine_loop.submit(recorder.job(ask("empty", prompt="")))
    engine_loop.submit(recorder.job(ask("chat", prompt="chat-without-template")))
    engine_loop.submit(recorder.job(ask("good")))
    assert recorder.until_end("empty")[1]["code"] == "invalid_params"
    assert recorder.until_end("chat")[1]["code"] == "invalid_params"
    assert recorder.until_end("good")[1]["event"] == "done"


def test_an_expert_that_cannot_load_ends_the_requests_of_its_step_and_the_rest_go_on(engine):
    with running(engine, max_batch=1) as engine_loop:
        recorder = Recorder()
        engine_loop.submit(recorder.job(ask("bad", prompt="!x")))
        engine_loop.submit(recorder.job(ask("hot", prompt="~x")))
        engine_loop.submit(recorder.job(ask("good")))
        assert recorder.until_end("bad")[1]["code"] == "engine"
        error = recorder.until_end("hot")[1]
        assert (error["event"], error["code"]) == ("error", "thermal") and "86 °C" in error["message"]
        assert recorder.until_end("good")[1]["event"] == "done"


def test_a_request_that_can_never_fit_the_kv_budget_is_refused_and_one_that_can_waits(engine, pack):
    need = FaultyEngine(pack).start_generation([1, 2, 3], ask(0, prompt="abc", max_tokens=40).params)[1].state.nbytes
    engine.step_delay_s = 0.002
    with running(engine, kv_budget_bytes=int(1.5 * need)) as engine_loop:  # room for one such request at a time
        recorder = Recorder()
        engine_loop.submit(recorder.job(ask("huge", max_tokens=4000)))
        engine_loop.submit(recorder.job(ask("first", max_tokens=40)))
        engine_loop.submit(recorder.job(ask("second", max_tokens=40)))
        error = recorder.until_end("huge")[1]
        assert error["code"] == "invalid_params" and "kv_cache_size" in error["message"]
        assert recorder.until_end("first")[1]["finish_reason"] == "length"
        assert recorder.until_end("second")[1]["finish_reason"] == "length"
        assert max(engine.step_sizes) == 1  # the second waited for the first's memory


def test_stop_ends_the_running_and_the_waiting_jobs(engine):
    engine.step_delay_s = 0.002
    engine_loop = started(engine, max_batch=1)
    recorder = Recorder()
    engine_loop.submit(recorder.job(ask("running", max_tokens=10_000)))
    recorder.events.get(timeout=10)
    waiting = recorder.job(ask("waiting"))
    engine_loop.submit(waiting)
    assert engine_loop.stop() == [waiting]  # the caller ends the waiting ones
    assert recorder.until_end("running")[1]["code"] == "shutdown"
    assert engine_loop.join(10)
    with pytest.raises(IntakeClosed):
        engine_loop.submit(recorder.job(ask("late")))


def test_close_intake_drains_the_whole_batch(engine):
    engine_loop = started(engine, max_batch=3)
    recorder = Recorder()
    for n in range(5):
        engine_loop.submit(recorder.job(ask(n, max_tokens=6)))
    engine_loop.close_intake()
    assert [recorder.until_end(n)[1]["finish_reason"] for n in range(5)] == ["length"] * 5
    assert engine_loop.join(10)


def test_logprobs_carry_the_alternatives_text(engine_loop, engine):
    recorder = Recorder()
    engine_loop.submit(recorder.job(ask("lp", max_tokens=2, logprobs=1)))
    tokens, _ = recorder.until_end("lp")
    token_id, text, logprob = tokens[0]["top_logprobs"][0]
    assert text == engine.tokenizer.decode([token_id]) and logprob == tokens[0]["logprob"]


def test_status_shows_each_running_request_and_the_batch(engine):
    engine.step_delay_s = 0.002
    with running(engine, max_batch=4) as engine_loop:
        recorder = Recorder()
        for n in range(2):
            engine_loop.submit(recorder.job(ask(n, max_tokens=10_000)))
        deadline = time.monotonic() + 10
        while engine_loop.requests_running < 2 or any(r["tokens"] < 2 for r in engine_loop.running_status()):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        requests = engine_loop.running_status()
        assert {r["id"] for r in requests} == {0, 1} and {r["phase"] for r in requests} == {"decode"}
        assert all(r["peer"] == "a client" and r["tokens_per_s"] > 0 for r in requests)
        batch, kv = engine_loop.batch_status(), engine_loop.kv_status()
        assert batch["max_batch"] == 4 and batch["size"] == 2 and batch["steps"] > 0
        assert 0 < batch["distinct_experts_per_layer_step"] <= batch["sequence_experts_per_layer_step"]
        assert kv["budget_bytes"] == BIG_BUDGET and kv["used_bytes"] > 0 and kv["sequences"] == 2
        assert kv["type"] == "f32"
