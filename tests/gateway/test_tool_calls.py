"""Tool calling end to end, with the openai package: `tools` reach the chat template inside
colibrid, and the call the model writes (Hermes convention) comes back as `tool_calls` with
arguments a JSON string - streamed and not. The model is tests/gateway/steered_pack.py's,
whose greedy answer to any conversation is that call."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from colibrid.engine.text.tokenizer import Tokenizer
from tests.daemon.conftest import DaemonProcess
from tests.gateway.conftest import GatewayProcess
from tests.gateway.steered_pack import ANSWER_TEXT, build_steered_pack
from tests.hermes_template import TOOL_CONVERSATION, WEATHER_TOOL

openai = pytest.importorskip("openai")

QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def steered():
    directory = Path(tempfile.mkdtemp(prefix="colibri-gw-"))
    pack = build_steered_pack(directory)
    daemon = DaemonProcess(pack, directory / "colibrid.sock")
    gateway = GatewayProcess(daemon.socket_path)
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=30)
    yield pack, client
    gateway.stop()
    daemon.terminate()
    shutil.rmtree(directory, ignore_errors=True)


def test_the_tool_call_comes_back_as_tool_calls(steered):
    pack, client = steered
    completion = client.chat.completions.create(model="steered", messages=QUESTION, tools=[WEATHER_TOOL],
                                                temperature=0, max_tokens=8)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert isinstance(call.function.arguments, str) and json.loads(call.function.arguments) == {"city": "Paris"}
    # The tools were in the prompt: exactly the tokens the pack's template makes of them.
    tokenizer = Tokenizer.from_dir(pack)
    with_tools = tokenizer.encode_chat(QUESTION, tools=[WEATHER_TOOL])
    assert completion.usage.prompt_tokens == len(with_tools) > len(tokenizer.encode_chat(QUESTION)) + 50


def test_streamed_tool_call(steered):
    _, client = steered
    chunks = list(client.chat.completions.create(model="steered", messages=QUESTION, tools=[WEATHER_TOOL],
                                                 temperature=0, max_tokens=8, stream=True))
    calls = [call for chunk in chunks for call in (chunk.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].function.name == "get_weather"
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_whole_tool_conversation_renders_and_the_next_call_comes(steered):
    pack, client = steered
    messages = [*TOOL_CONVERSATION]
    completion = client.chat.completions.create(model="steered", messages=messages, tools=[WEATHER_TOOL],
                                                temperature=0, max_tokens=8)
    assert completion.choices[0].message.tool_calls[0].function.name == "get_weather"
    # The assistant turn went back in as OpenAI sends it (arguments a JSON string); the template saw a map.
    expected = Tokenizer.from_dir(pack).encode_chat(
        [*messages[:2], {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]}, *messages[3:]], tools=[WEATHER_TOOL])
    assert completion.usage.prompt_tokens == len(expected)


def test_without_tools_the_same_text_is_plain_content(steered):
    _, client = steered
    completion = client.chat.completions.create(model="steered", messages=QUESTION, temperature=0, max_tokens=8)
    assert completion.choices[0].message.content == ANSWER_TEXT
    assert completion.choices[0].message.tool_calls is None and completion.choices[0].finish_reason == "stop"
