"""The `routing` stream and `debug_routing`, over the socket (docs/protocol.md)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from colibrid.engine.routing_capture import RoutingCapture
from colibrid.daemon.routing_stream import RoutingStream
from colibrid.wire.events import RoutingEvent
from tests.daemon.wire import WireClient

PROMPT = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)"


def subscribe(client: WireClient, request_id="r") -> dict:
    client.send({"op": "subscribe", "id": request_id, "stream": "routing"})
    return client.recv()


def status(socket_path) -> dict:
    with WireClient(socket_path) as client:
        client.hello()
        client.send({"op": "status", "id": "s"})
        return client.recv()


def routing_until_step(client: WireClient, last_step: int) -> list[dict]:
    """Routing events until the one of ``last_step``."""
    events = []
    while not events or events[-1]["step"] < last_step:
        event = client.recv()
        assert event["event"] == "routing", event
        events.append(event)
    return events


def test_the_stream_and_debug_routing_tell_the_same_story(shared_daemon):
    with WireClient(shared_daemon.socket_path) as watcher, WireClient(shared_daemon.socket_path) as asker:
        watcher.hello()
        asker.hello()
        subscribed = subscribe(watcher)
        assert subscribed == {"event": "subscribed", "id": "r", "stream": "routing", "moe_layers": [0, 1, 2, 3],
                              "num_experts": 16, "experts_per_token": 4}
        asker.ask("a", PROMPT, max_tokens=6, ignore_eos=True, debug_routing=True)
        tokens, done = asker.collect("a")
        asker.ask("b", PROMPT, max_tokens=2)  # without debug_routing: no routing field
        plain, _ = asker.collect("b")
        assert done["event"] == "done" and len(tokens) == 6
        assert all("routing" not in token for token in plain)
        events = {event["step"]: event for event in routing_until_step(watcher, tokens[-1]["routing"]["step"])}

    steps = [token["routing"]["step"] for token in tokens]
    assert steps == list(range(steps[0], steps[0] + 6))  # one token a step, each step seen by the watcher
    assert events[steps[0]]["rows"] == done["usage"]["prompt_tokens"]  # the prompt ran in one step
    for token in tokens:
        routing, summary = token["routing"], events[token["routing"]["step"]]
        assert summary["dropped"] == 0 and summary["sequences"] == 1
        assert routing["layers"] == [entry["layer"] for entry in summary["layers"]] == [0, 1, 2, 3]
        for experts, weights, entry in zip(routing["experts"], routing["weights"], summary["layers"]):
            assert len(set(experts)) == 4 and len(weights) == 4
            assert weights == sorted(weights, reverse=True)  # best first
            assert set(experts) <= set(entry["experts"])  # the token's position is one of the step's rows
            if summary["rows"] == 1:  # a decode step: this token's row is the whole step
                assert entry["experts"] == sorted(experts) and entry["counts"] == [1, 1, 1, 1]
            assert sum(entry["counts"]) == 4 * summary["rows"]
            # every distinct expert of a layer step is acquired once: a hit or a miss
            assert entry["hits"] + entry["misses"] == len(entry["experts"])


def test_subscriptions_are_refused_past_the_limit_and_end_on_cancel(shared_daemon):
    with WireClient(shared_daemon.socket_path) as client:
        client.hello()
        client.send({"op": "subscribe", "id": "x", "stream": "tokens"})
        assert client.recv()["code"] == "invalid_params"
        for n in range(8):
            assert subscribe(client, n)["event"] == "subscribed"
        refused = subscribe(client, 8)
        assert (refused["event"], refused["code"], refused["id"]) == ("error", "busy", 8)
        client.send({"op": "cancel", "id": "c", "target": 3})
        assert client.recv() == {"event": "ok", "id": "c"}
        assert client.recv() == {"event": "unsubscribed", "id": 3, "reason": "cancelled"}
        assert subscribe(client, 8)["event"] == "subscribed"  # the freed place is taken again
        client.send({"op": "subscribe", "id": 8, "stream": "routing"})  # its id is open
        assert client.recv()["code"] == "bad_request"
    with WireClient(shared_daemon.socket_path) as client:  # the closed connection's subscriptions ended with it
        client.hello()
        assert subscribe(client)["event"] == "subscribed"
        client.send({"op": "subscribe", "id": "y"})
        assert client.recv()["code"] == "bad_request"


def test_a_subscriber_that_never_reads_holds_back_nobody(shared_daemon):
    steps_before = status(shared_daemon.socket_path)["batch"]["steps"]
    with WireClient(shared_daemon.socket_path) as sleeper, WireClient(shared_daemon.socket_path) as asker:
        sleeper.hello()
        assert subscribe(sleeper)["event"] == "subscribed"
        asker.hello()
        for n in range(3):  # the sleeper reads nothing meanwhile
            asker.ask(n, PROMPT, max_tokens=40, ignore_eos=True)
            _, done = asker.collect(n)
            assert done["event"] == "done" and done["usage"]["generated_tokens"] == 40
        assert status(shared_daemon.socket_path)["requests_running"] == 0
        steps_after = status(shared_daemon.socket_path)["batch"]["steps"]
        received = routing_until_step(sleeper, steps_after)
    # nothing lost without a count: each step's summary was sent or counted as dropped
    assert len(received) + sum(event["dropped"] for event in received) == steps_after - steps_before


def _capture_step(capture: RoutingCapture, rows: int) -> None:
    capture.begin_step(np.array([0, rows], np.int64))
    for layer in capture.moe_layers:
        experts = np.tile(np.arange(4, dtype=np.int32), (rows, 1))  # (T, A)
        capture.record(layer, experts, np.full((rows, 4), 0.25, np.float32))


def test_the_stream_bounds_what_waits_for_a_subscriber_and_counts_what_it_drops():
    """A subscriber whose connection holds its backlog already gets nothing more queued; every
    summary it misses is counted in the next one it gets."""
    capture = RoutingCapture([0, 1], num_experts=16)
    stream = RoutingStream(capture, lambda: None, max_pending=16)
    outbox: list[dict] = []
    unread = {"bytes": 0}

    def send(event: RoutingEvent) -> None:
        outbox.append(event.to_wire())  # what the connection would send
        unread["bytes"] += 1000

    async def run() -> None:
        stream.subscribe("r", send, lambda: unread["bytes"], max_outbox_bytes=20_000)  # backlog 10 kB: ~10 events

        def engine_thread(steps: int, first: int) -> None:
            for step in range(first, first + steps):
                stream.before_step(debug_asks=False)
                _capture_step(capture, rows=1)
                stream.after_step(step)

        worker = threading.Thread(target=engine_thread, args=(500, 1))
        worker.start()
        while worker.is_alive():
            await asyncio.sleep(0.001)
        worker.join()
        await asyncio.sleep(0.05)  # the last delivery
        assert 10 <= len(outbox) <= 11  # never more than the backlog, whatever the engine made
        unread["bytes"] = 0  # the client reads it all
        engine_thread(1, 501)
        await asyncio.sleep(0.05)

    asyncio.run(run())
    assert outbox[-1]["step"] == 501
    assert len(outbox) + sum(event["dropped"] for event in outbox) == 501
    assert outbox[0]["layers"][0] == {"layer": 0, "experts": [0, 1, 2, 3], "counts": [1, 1, 1, 1],
                                      "hits": None, "misses": None}


def test_nothing_is_captured_while_nobody_watches():
    capture = RoutingCapture([0], num_experts=16)
    stream = RoutingStream(capture, lambda: pytest.fail("no counters are read without subscribers"))
    stream.before_step(debug_asks=False)
    assert not capture.enabled and stream.after_step(1) is None
    stream.before_step(debug_asks=True)  # an ask wants its tokens' routing: captured, not published
    _capture_step(capture, rows=3)
    routing = stream.after_step(2)
    assert capture.enabled and routing is not None and routing.rows == 3 and stream.summaries_made == 0


def test_a_stopping_daemon_ends_its_subscriptions(start_daemon):
    daemon = start_daemon()
    with WireClient(daemon.socket_path) as client:
        client.hello()
        assert subscribe(client)["event"] == "subscribed"
        returncode, _ = daemon.terminate()
        assert client.recv() == {"event": "unsubscribed", "id": "r", "reason": "shutdown"}
        assert client.is_closed_by_server()
    assert returncode == 0
