"""colibrid over a real socket: what a well-behaved client sees (docs/protocol.md)."""

from __future__ import annotations

import shutil
import threading
import time

import pytest

from tests.daemon.wire import WireClient

# Long enough (seconds of decoding on the demo pack) that it is surely still running when the
# test acts on it; every test that starts one ends it (cancel, disconnect, shutdown).
LONG_MAX_TOKENS = 3000


def test_hello_announces_protocol_model_and_frame_limit(shared_daemon):
    with WireClient(shared_daemon.socket_path) as client:
        hello = client.hello(request_id=7)
    assert hello == {"event": "hello", "id": 7, "protocol": 1, "server": "colibrid 0.1.0", "model": "demo",
                     "max_frame_bytes": 1048576}


def test_greedy_tokens_over_the_socket_equal_the_engine_in_process(shared_daemon, demo_pack):
    from colibrid.engine import load

    engine = load(demo_pack)
    prompt = "def fibonacci(n):"
    expected = engine.greedy(engine.prompt_ids(prompt=prompt, raw=True), max_tokens=12)

    with WireClient(shared_daemon.socket_path) as client:
        client.hello()
        client.ask("g", prompt, max_tokens=12)
        tokens, done = client.collect("g")
    got = [t for event in tokens for t in event["token_ids"]]
    assert done["event"] == "done" and done["finish_reason"] in ("length", "eos")
    assert got == expected[: len(got)] and (done["finish_reason"] == "eos" or got == expected)
    assert done["text"] == "".join(event["text"] for event in tokens)
    usage = done["usage"]
    assert usage["generated_tokens"] == len(got)
    assert usage["prompt_tokens"] == len(engine.prompt_ids(prompt=prompt, raw=True))
    assert set(usage) == {"prompt_tokens", "cached_prompt_tokens", "generated_tokens", "time_to_first_token_ms",
                          "decode_tokens_per_s", "expert_cache_hits", "expert_cache_misses"}


def test_logprobs_come_with_each_token_best_first(shared_daemon):
    with WireClient(shared_daemon.socket_path) as client:
        client.hello()
        client.ask(1, max_tokens=3, logprobs=3)
        tokens, done = client.collect(1)
    assert done["event"] == "done"
    for event in tokens:
        alternatives = event["top_logprobs"]
        assert len(alternatives) == 3
        assert [a[0] for a in alternatives][0] == event["token_ids"][0]  # greedy: the chosen one is the best
        assert alternatives[0][2] == pytest.approx(event["logprob"])
        assert all(isinstance(a[1], str) for a in alternatives)
        assert [a[2] for a in alternatives] == sorted((a[2] for a in alternatives), reverse=True)


def test_eight_clients_at_once_each_get_their_own_stream(shared_daemon):
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def run(n: int) -> None:
        try:
            with WireClient(shared_daemon.socket_path) as client:
                client.hello()
                # Different prompts give different outputs, so crossed streams would show.
                client.ask(f"client-{n}", prompt=f"{n} " * (n + 1), max_tokens=6)
                results[n] = client.collect(f"client-{n}")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert sorted(results) == list(range(8))
    for tokens, done in results.values():
        assert done["event"] == "done"
        assert done["text"] == "".join(event["text"] for event in tokens)
        assert done["usage"]["generated_tokens"] == len(tokens)


def test_two_asks_on_one_connection_interleave_by_id(shared_daemon):
    with WireClient(shared_daemon.socket_path) as client:
        client.hello()
        client.ask("a", "The quick brown fox", max_tokens=5)
        client.ask(2, "import os", max_tokens=4)
        results = client.collect_all(["a", 2])
    assert results["a"][1]["usage"]["generated_tokens"] == 5 == len(results["a"][0])
    assert results[2][1]["usage"]["generated_tokens"] == 4 == len(results[2][0])
    for tokens, done in results.values():
        assert done["text"] == "".join(event["text"] for event in tokens)


def test_a_reused_id_is_refused_while_open(shared_daemon):
    with WireClient(shared_daemon.socket_path) as client:
        client.hello()
        client.ask("x", max_tokens=LONG_MAX_TOKENS)
        client.ask("x", max_tokens=1)
        events = []
        while True:
            event = client.recv()
            events.append(event)
            if event["event"] == "error":
                break
        assert event["code"] == "bad_request" and event["id"] == "x"
        assert client.is_closed_by_server()


def test_cancel_ends_the_ask_with_done_cancelled(shared_daemon):
    with WireClient(shared_daemon.socket_path) as client:
        client.hello()
        client.ask("long", max_tokens=LONG_MAX_TOKENS)
        assert client.recv()["event"] == "token"
        client.send({"op": "cancel", "id": "c", "target": "long"})
        seen_ok = False
        while True:
            event = client.recv()
            if event["id"] == "c":
                assert event == {"event": "ok", "id": "c"}
                seen_ok = True
            elif event["event"] != "token":
                break
        assert seen_ok
        assert event["event"] == "done" and event["id"] == "long" and event["finish_reason"] == "cancelled"
        assert 1 <= event["usage"]["generated_tokens"] < LONG_MAX_TOKENS

        client.send({"op": "cancel", "id": "again", "target": "long"})
        error = client.recv()
        assert (error["event"], error["id"], error["code"]) == ("error", "again", "unknown_request")
        client.ask("after", max_tokens=2)  # the connection stays open
        assert client.collect("after")[1]["event"] == "done"


def test_a_client_that_disconnects_mid_stream_frees_its_place(shared_daemon):
    with WireClient(shared_daemon.socket_path) as quitter:
        quitter.hello()
        quitter.ask("long", max_tokens=LONG_MAX_TOKENS)
        assert quitter.recv()["event"] == "token"
    start_s = time.monotonic()
    with WireClient(shared_daemon.socket_path) as client:
        client.hello()
        client.ask("next", max_tokens=3)
        _, done = client.collect("next")
    assert done["event"] == "done"
    # The abandoned ask had seconds of decoding left; the next one ran as soon as it stopped.
    assert time.monotonic() - start_s < 5.0


def test_invalid_params_and_empty_prompts_cost_only_the_request(shared_daemon):
    with WireClient(shared_daemon.socket_path) as client:
        client.hello()
        client.ask("hot", temperature=-1.0)
        error = client.recv()
        assert (error["id"], error["code"]) == ("hot", "invalid_params") and "temperature" in error["message"]
        client.send({"op": "ask", "id": "empty", "prompt": "", "raw": True})
        assert client.recv()["code"] == "invalid_params"
        client.ask("fine", max_tokens=1)
        assert client.collect("fine")[1]["event"] == "done"


def test_status_reports_the_model_the_cache_and_the_queue(shared_daemon):
    with WireClient(shared_daemon.socket_path) as client:
        client.hello()
        client.ask(1, max_tokens=2)
        client.collect(1)
        client.send({"op": "status", "id": "s"})
        status = client.recv()
        client.send({"op": "models", "id": "m"})
        models = client.recv()
    assert status["event"] == "status" and status["id"] == "s"
    assert {"model", "path", "architecture", "parameters_total", "parameters_active", "quantization", "memory",
            "cache", "uptime_s", "requests_served", "requests_running", "queue_depth", "queue_limit",
            "version"} <= set(status)
    assert status["model"] == "demo" and status["architecture"] == "olmoe"
    assert status["parameters_total"] > status["parameters_active"] > 0
    assert status["memory"]["rss_bytes"] > 0 and status["memory"]["dense_bytes"] > 0
    assert status["cache"]["misses"] > 0 and status["cache"]["bytes_read"] > 0
    assert status["requests_served"] >= 1 and status["requests_running"] == 0
    assert status["queue_depth"] == 0 and status["queue_limit"] == 16
    assert status["version"] == "0.1.0"
    (model,) = models["models"]
    assert {k: model[k] for k in ("name", "architecture")} == {"name": "demo", "architecture": "olmoe"}
    assert model["parameters_total"] == status["parameters_total"]


def test_status_says_the_pack_is_not_on_nvme_and_runs_unthrottled(shared_daemon):
    """These machines have one virtio disk: the thermal watch must say so plainly, not fail."""
    with WireClient(shared_daemon.socket_path) as client:
        client.hello()
        client.send({"op": "status", "id": "s"})
        thermal = client.recv()["thermal"]
    assert thermal["state"] == "unthrottled" and thermal["drives"] == []
    assert thermal["reason"].startswith("no NVMe device: ") and "experts.bin is on " in thermal["reason"]
    assert thermal["loading_paused"] is None and thermal["prefetch_paused"] is False
    assert thermal["io_queue_depth"] == 16


def test_a_full_queue_answers_busy_at_once(start_daemon):
    daemon = start_daemon("--max-queue", "1", "--max-batch", "1")  # one runs, one waits, the next is refused
    with WireClient(daemon.socket_path) as client:
        client.hello()
        client.ask("running", max_tokens=LONG_MAX_TOKENS)
        assert client.recv()["event"] == "token"  # it runs: the queue is empty again
        client.ask("waiting", max_tokens=1)
        client.ask("refused", max_tokens=1)
        while (event := client.recv())["event"] == "token":
            pass
        assert (event["event"], event["id"], event["code"]) == ("error", "refused", "busy")
        client.send({"op": "status", "id": "s"})
        while (status := client.recv())["event"] != "status":
            pass
        assert (status["requests_running"], status["queue_depth"], status["queue_limit"]) == (1, 1, 1)
        client.send({"op": "cancel", "id": "c", "target": "running"})
        ends = {}
        while len(ends) < 2:
            event = client.recv()
            if event["event"] == "done":
                ends[event["id"]] = event["finish_reason"]
        assert ends["running"] == "cancelled" and ends["waiting"] in ("length", "eos")


def test_a_client_that_does_not_read_holds_up_nobody(shared_daemon):
    # Generous timeouts: 600 tokens take ~5 s alone, longer on a busy machine.
    with WireClient(shared_daemon.socket_path, timeout_s=60) as sleeper:
        sleeper.hello()
        # ~600 KB of events (20 alternatives per token): more than the socket buffers hold.
        sleeper.ask("unread", max_tokens=600, logprobs=20)
        with WireClient(shared_daemon.socket_path, timeout_s=60) as client:
            client.hello()
            client.ask("mine", max_tokens=3)
            _, done = client.collect("mine")  # it ran after "unread", which did not wait for its reader
            assert done["event"] == "done"
        tokens, done = sleeper.collect("unread")  # and nothing of the sleeper's was lost
    assert done["event"] == "done" and len(tokens) == done["usage"]["generated_tokens"]


def test_an_expert_that_fails_its_checksum_costs_only_the_request(start_daemon, demo_pack, socket_dir):
    damaged = socket_dir / "damaged.pack"
    shutil.copytree(demo_pack, damaged)
    with open(damaged / "experts.bin", "r+b") as experts:
        size = experts.seek(0, 2)
        experts.seek(0)
        experts.write(b"\xff" * size)  # every record now fails its CRC-32C
    daemon = start_daemon("--model", str(damaged))
    with WireClient(daemon.socket_path) as client:
        client.hello()
        client.ask("hurt", max_tokens=2)
        error = client.recv()
        assert (error["event"], error["id"], error["code"]) == ("error", "hurt", "pack_damaged")
        assert "layer" in error["message"] and "colibri-verify" in error["message"]
        assert {"layer", "expert", "offset"} <= set(error["damage"]) and error["damage"]["found_by"] == "load"
        client.send({"op": "status", "id": "s"})  # the connection and the daemon carry on
        assert client.recv()["event"] == "status"


def test_a_chat_and_a_stop_string(shared_daemon):
    with WireClient(shared_daemon.socket_path) as client:
        client.hello()
        client.send({"op": "ask", "id": "chat", "messages": [{"role": "user", "content": "hi"}],
                     "system": "Be brief.", "temperature": 0, "max_tokens": 4})
        tokens, done = client.collect("chat")
        assert done["event"] == "done" and done["usage"]["prompt_tokens"] > 5  # the template's tokens too
        full_text = done["text"]
        assert len(full_text) >= 2  # the demo pack's greedy reply; a stop string is cut from it
        stop = full_text[1:]
        client.send({"op": "ask", "id": "stopped", "messages": [{"role": "user", "content": "hi"}],
                     "system": "Be brief.", "temperature": 0, "max_tokens": 4, "stop": [stop]})
        _, stopped = client.collect("stopped")
    assert stopped["finish_reason"] == "stop" and stopped["text"] == full_text[: full_text.index(stop)]


def test_the_settings_that_shape_requests(start_daemon):
    daemon = start_daemon("--max-frame-bytes", "1024", "--default-max-tokens", "3", "--max-context", "64")
    with WireClient(daemon.socket_path) as client:
        assert client.hello()["max_frame_bytes"] == 1024
        client.send({"op": "ask", "id": "default", "prompt": "x", "raw": True, "temperature": 0})
        assert client.collect("default")[1]["usage"]["generated_tokens"] == 3
        client.ask("long", prompt="word " * 120)  # < 1024 bytes, > 64 tokens
        error = client.recv()
        assert (error["id"], error["code"]) == ("long", "invalid_params") and "context" in error["message"]
        client.ask("big", prompt="x" * 2000)
        error = client.recv()
        assert (error["code"], error["id"]) == ("frame_too_large", None)
        assert client.is_closed_by_server()


# -- many clients at once: one batch ------------------------------------------------------------


def _ask_alone(socket_path, request_id, prompt, fields) -> tuple[list[int], str, str]:
    with WireClient(socket_path) as client:
        client.hello()
        client.ask(request_id, prompt, **fields)
        tokens, done = client.collect(request_id)
    assert done["event"] == "done", done
    return [t for event in tokens for t in event["token_ids"]], done["text"], done["finish_reason"]


def test_eight_clients_at_once_each_get_exactly_what_they_get_alone(shared_daemon):
    asks = [(f"c{n}", f"client {n} asks: " + "why " * (3 * n + 1),
             dict(max_tokens=8 + 5 * n, ignore_eos=True, **({"temperature": 0.8, "seed": 1000 + n} if n % 2 else {})))
            for n in range(8)]
    results: dict[str, tuple] = {}
    status_seen: list[dict] = []

    def client(request_id, prompt, fields):
        time.sleep(0.02 * int(request_id[1:]))  # they start at different times and join a running batch
        results[request_id] = _ask_alone(shared_daemon.socket_path, request_id, prompt, fields)

    threads = [threading.Thread(target=client, args=a) for a in asks]
    for thread in threads:
        thread.start()
    with WireClient(shared_daemon.socket_path) as watcher:  # status while they run
        watcher.hello()
        while any(thread.is_alive() for thread in threads):
            watcher.send({"op": "status", "id": "s"})
            status_seen.append(watcher.recv())
            time.sleep(0.01)
    for thread in threads:
        thread.join()
    assert len(results) == 8
    alone = {request_id: _ask_alone(shared_daemon.socket_path, request_id, prompt, fields)
             for request_id, prompt, fields in asks}
    assert results == alone
    assert max(status["batch"]["last_step_size"] for status in status_seen) > 1  # they really shared steps
    running = [r for status in status_seen for r in status["running"]]
    assert running and {"id", "peer", "phase", "tokens", "tokens_per_s"} <= set(running[0])
    assert all(status["kv_cache"]["used_bytes"] <= status["kv_cache"]["budget_bytes"] for status in status_seen)


def test_a_daemon_with_float16_kv_caches_answers_and_says_so(start_daemon):
    daemon = start_daemon("--kv-cache-type", "f16")
    tokens, text, finish = _ask_alone(daemon.socket_path, "q", "why is the sky blue", dict(max_tokens=6, ignore_eos=True))
    assert len(tokens) == 6 and text and finish == "length"
    with WireClient(daemon.socket_path) as client:
        client.hello()
        client.send({"op": "status", "id": "s"})
        assert client.recv()["kv_cache"]["type"] == "f16"
    returncode, stderr = daemon.terminate()
    assert returncode == 0 and "keys and values as f16 (kv_cache_type)" in stderr
