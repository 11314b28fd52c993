"""Real clients in numbers and curl: 32 concurrent streamed requests through the gateway, each
answered with exactly what it gets when asked alone; curl's view of SSE and JSON."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess

import pytest

openai = pytest.importorskip("openai")

CONCURRENT = 32
MAX_TOKENS = 8


def _prompt(index: int) -> str:
    return f"def function_{index}(x):"


def test_32_concurrent_streams_lose_nothing_and_cross_nothing(demo_gateway):
    async def stream_one(client, index: int) -> tuple[str, str, str]:
        stream = await client.completions.create(model="demo", prompt=_prompt(index), temperature=0,
                                                 max_tokens=MAX_TOKENS, stream=True)
        texts, ids, finish = [], set(), None
        async for chunk in stream:
            ids.add(chunk.id)
            if chunk.choices:
                texts.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
        assert len(ids) == 1
        return "".join(texts), ids.pop(), finish

    async def run_all():
        async with openai.AsyncOpenAI(base_url=demo_gateway.url + "/v1", api_key="x", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(stream_one(client, index) for index in range(CONCURRENT)))

    results = asyncio.run(run_all())
    assert len({completion_id for _, completion_id, _ in results}) == CONCURRENT
    alone = openai.OpenAI(base_url=demo_gateway.url + "/v1", api_key="x", max_retries=0, timeout=30)
    expected = [alone.completions.create(model="demo", prompt=_prompt(index), temperature=0,
                                         max_tokens=MAX_TOKENS).choices[0] for index in range(CONCURRENT)]
    assert len({choice.text for choice in expected}) > 1, "the prompts must differ in answer, or crossing would hide"
    assert [(text, finish) for text, _, finish in results] == [(choice.text, choice.finish_reason)
                                                               for choice in expected]


needs_curl = pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")


def _curl(*args: str) -> str:
    return subprocess.run(["curl", "-sS", "--fail-with-body", "--max-time", "30", *args], capture_output=True,
                          text=True, check=True).stdout


@needs_curl
def test_curl_chat_completion(demo_gateway):
    body = {"model": "demo", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5, "temperature": 0}
    answer = json.loads(_curl(demo_gateway.url + "/v1/chat/completions", "-H", "Content-Type: application/json",
                              "-d", json.dumps(body)))
    assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] == 5
    assert isinstance(answer["choices"][0]["message"]["content"], str)


@needs_curl
def test_curl_streams_server_sent_events_ending_with_done(demo_gateway):
    body = {"model": "demo", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    output = _curl("-N", demo_gateway.url + "/v1/chat/completions", "-d", json.dumps(body))
    events = [line.removeprefix("data: ") for line in output.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in output.split("\n\n") if line)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 5 and chunks[-1]["choices"] == []
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}


@needs_curl
def test_curl_health_and_metrics(demo_gateway):
    assert json.loads(_curl(demo_gateway.url + "/health"))["status"] == "ok"
    assert "colibri_daemon_up 1.0" in _curl(demo_gateway.url + "/metrics")
