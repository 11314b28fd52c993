"""The HTTP layer in front of a scripted colibrid (tests/colibrictl/fake_daemon.py): error
statuses, auth, limits, cancellation on disconnect, the request that reaches the daemon, and
the metrics read from its status."""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from tests.colibrictl.fake_daemon import answer, endless, fail
from tests.hermes_template import TOOL_CONVERSATION, WEATHER_TOOL

openai = pytest.importorskip("openai")


def post(gateway, path: str, body, headers: dict | None = None) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(gateway.url + path, data=data, method="POST",
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), json.loads(error.read())


def get(gateway, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(gateway.url + path, timeout=20) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


CHAT = {"model": "fake-moe", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("code, status", [("busy", 429), ("invalid_params", 400), ("thermal", 503),
                                          ("device_missing", 503), ("pack_damaged", 503), ("engine", 500)])
def test_daemon_errors_become_openai_shaped_statuses(fake_daemon, start_gateway, code, status):
    gateway = start_gateway(fake_daemon(fail(code, f"the daemon says {code}")).socket_path)
    for stream in (False, True):  # a streamed request learns it from the status too: no byte was sent before
        got, headers, body = post(gateway, "/v1/chat/completions", {**CHAT, "stream": stream})
        assert got == status
        assert body["error"]["message"] == f"the daemon says {code}" and body["error"]["code"] == code
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert ("Retry-After" in headers) == (status in (429, 503))


def test_busy_is_a_rate_limit_error_for_the_openai_client(fake_daemon, start_gateway):
    gateway = start_gateway(fake_daemon(fail("busy", "queue full")).socket_path)
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="fake-moe", messages=[{"role": "user", "content": "hi"}])


def test_a_daemon_that_is_not_there_is_503_and_health_says_so(short_dir, start_gateway):
    gateway = start_gateway(short_dir / "nobody.sock")
    got, headers, body = post(gateway, "/v1/chat/completions", CHAT)
    assert got == 503 and headers["Retry-After"] == "1" and body["error"]["code"] == "daemon_unavailable"
    assert get(gateway, "/health")[0] == 503
    metrics = get(gateway, "/metrics")[1]
    assert "colibri_daemon_up 0.0" in metrics
    assert 'colibri_requests_total{endpoint="chat",outcome="unavailable"} 1.0' in metrics


def test_what_reaches_the_daemon(fake_daemon, start_gateway):
    daemon = fake_daemon(answer("ok"))
    gateway = start_gateway(daemon.socket_path)
    body = {"model": "fake-moe", "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Paris?"}]},
                *TOOL_CONVERSATION[2:4]],
            "tools": [WEATHER_TOOL], "tool_choice": "auto", "max_completion_tokens": 7, "temperature": 0.5,
            "top_p": 0.9, "seed": 11, "stop": "END", "logprobs": True, "top_logprobs": 2,
            "presence_penalty": 0.1, "user": "someone", "some_future_field": {"x": 1}}  # ignored as OpenAI ignores them
    assert post(gateway, "/v1/chat/completions", body)[0] == 200
    ask = daemon.requests_with("ask")[-1]
    assert ask["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                              "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'}]
    assert ask["tools"] == [WEATHER_TOOL] and ask["special_tokens"] is True
    assert (ask["max_tokens"], ask["temperature"], ask["top_p"], ask["seed"], ask["stop"], ask["logprobs"]) == \
        (7, 0.5, 0.9, 11, ["END"], 2)
    assert "presence_penalty" not in ask and "user" not in ask

    post(gateway, "/v1/chat/completions", {**body, "tool_choice": "none"})
    assert "tools" not in daemon.requests_with("ask")[-1]
    other = {"type": "function", "function": {"name": "other"}}
    post(gateway, "/v1/chat/completions", {**body, "tools": [WEATHER_TOOL, other],
                                           "tool_choice": {"type": "function", "function": {"name": "other"}}})
    assert daemon.requests_with("ask")[-1]["tools"] == [other]
    post(gateway, "/v1/completions", {"model": "fake-moe", "prompt": "x"})
    completion_ask = daemon.requests_with("ask")[-1]
    assert completion_ask["raw"] is True and completion_ask["max_tokens"] == 16 and "special_tokens" not in completion_ask


@pytest.mark.parametrize("body, param", [
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({**CHAT, "temperature": 3}, "temperature"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({**CHAT, "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_bad_requests_are_400_naming_the_parameter(fake_daemon, start_gateway, body, param):
    daemon = fake_daemon()
    gateway = start_gateway(daemon.socket_path)
    status, _, answer_body = post(gateway, "/v1/chat/completions", body)
    assert status == 400 and answer_body["error"]["param"] == param, answer_body
    assert daemon.requests_with("ask") == []


def test_not_json_and_too_large_bodies(fake_daemon, start_gateway):
    gateway = start_gateway(fake_daemon().socket_path, "--max-request-bytes", "2000")
    assert post(gateway, "/v1/chat/completions", b"{not json")[0] == 400
    status, _, body = post(gateway, "/v1/chat/completions", {**CHAT, "pad": "x" * 5000})
    assert status == 413 and "max_request_bytes" in body["error"]["message"]
    assert get(gateway, "/v1/nothing")[0] == 404


def test_api_keys_guard_the_api_but_not_health_and_metrics(fake_daemon, start_gateway, short_dir):
    keys = short_dir / "keys"
    keys.write_text("# the team's keys\nsk-first\n\nsk-second\n")
    gateway = start_gateway(fake_daemon().socket_path, "--api-keys-file", str(keys))
    assert post(gateway, "/v1/chat/completions", CHAT)[0] == 401
    status, _, body = post(gateway, "/v1/chat/completions", CHAT, {"Authorization": "Bearer sk-wrong"})
    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert post(gateway, "/v1/chat/completions", CHAT, {"Authorization": "Bearer sk-second"})[0] == 200
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-first", max_retries=0)
    assert client.models.list().data[0].id == "fake-moe"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gateway.url + "/v1", api_key="sk-nope", max_retries=0).models.list()
    assert get(gateway, "/health")[0] == 200 and get(gateway, "/metrics")[0] == 200


def test_an_empty_api_keys_file_stops_the_gateway_at_start(fake_daemon, start_gateway, short_dir):
    keys = short_dir / "keys"
    keys.write_text("# nobody yet\n")
    with pytest.raises(RuntimeError, match="holds no key"):
        start_gateway(fake_daemon().socket_path, "--api-keys-file", str(keys))


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_cancels_its_generation(fake_daemon, start_gateway, stream):
    daemon = fake_daemon(endless(delay_s=0.01))
    gateway = start_gateway(daemon.socket_path)
    connection = http.client.HTTPConnection(gateway.url.removeprefix("http://"), timeout=10)
    connection.request("POST", "/v1/chat/completions", json.dumps({**CHAT, "stream": stream}),
                       {"Content-Type": "application/json"})
    if stream:
        response = connection.getresponse()
        assert response.status == 200 and response.read(50)  # tokens are flowing
    else:
        deadline = time.monotonic() + 10
        while not daemon.requests_with("ask"):
            assert time.monotonic() < deadline
            time.sleep(0.02)
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    assert daemon.cancel_received.wait(10), "the gateway did not send cancel"
    cancel = daemon.requests_with("cancel")[0]
    assert cancel["target"] == daemon.requests_with("ask")[0]["id"]
    deadline = time.monotonic() + 10
    while 'outcome="client_disconnected"} 1.0' not in get(gateway, "/metrics")[1]:
        assert time.monotonic() < deadline, "the disconnect was not counted"
        time.sleep(0.05)


STATUS = {"model": "fake-moe", "queue_depth": 3, "queue_limit": 16, "requests_running": 1,
          "recent_tokens_per_s": 42.5, "memory": {"rss_bytes": 123456},
          "cache": {"hits": 90, "misses": 10, "bytes_read": 4096}, "requests_served": 7,
          "thermal": {"state": "throttled", "temperature_c": 71.5},
          "kv_cache": {"budget_bytes": 1000, "used_bytes": 250}, "batch": {"sequences": 2, "tokens": 9}}


def test_metrics_carry_the_daemon_s_gauges_and_the_gateway_s_own_measures(fake_daemon, start_gateway):
    daemon = fake_daemon(answer("a", "b", "c", delay_s=0.01), status=STATUS)
    gateway = start_gateway(daemon.socket_path)
    assert post(gateway, "/v1/chat/completions", CHAT)[0] == 200
    status, text = get(gateway, "/metrics")
    assert status == 200
    lines = set(text.splitlines())
    for expected in [
        "colibri_daemon_up 1.0", "colibri_queue_depth 3.0", "colibri_queue_limit 16.0",
        "colibri_requests_running 1.0", "colibri_recent_tokens_per_second 42.5",
        "colibri_expert_cache_hits_total 90.0", "colibri_expert_cache_misses_total 10.0",
        "colibri_expert_cache_read_bytes_total 4096.0", "colibri_kv_cache_budget_bytes 1000.0",
        "colibri_kv_cache_used_bytes 250.0", "colibri_kv_cache_usage_ratio 0.25",
        'colibri_thermal_state{state="throttled"} 1.0', 'colibri_thermal_state{state="normal"} 0.0',
        "colibri_drive_temperature_celsius 71.5", "colibri_batch_sequences 2.0", "colibri_batch_tokens 9.0",
        'colibri_requests_total{endpoint="chat",outcome="stop"} 1.0',
        "colibri_prompt_tokens_total 5.0", "colibri_generation_tokens_total 3.0",
        "colibri_time_to_first_token_seconds_count 1.0", "colibri_inter_token_latency_seconds_count 2.0",
    ]:
        assert expected in lines, expected


def test_without_kv_or_batch_in_status_their_gauges_are_left_out(fake_daemon, start_gateway):
    status = {key: value for key, value in STATUS.items() if key not in ("kv_cache", "batch")}
    status["thermal"] = {"state": "unthrottled", "temperature_c": None}
    gateway = start_gateway(fake_daemon(status=status).socket_path)
    text = get(gateway, "/metrics")[1]
    assert "colibri_kv_cache" not in text and "colibri_batch" not in text
    assert "colibri_drive_temperature_celsius" not in text
    assert 'colibri_thermal_state{state="unthrottled"} 1.0' in text
