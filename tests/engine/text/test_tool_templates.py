"""Tool calling reaches the chat template as transformers passes it: `tools`, assistant turns
with `tool_calls`, `tool` results. Checked against transformers' apply_chat_template on a
Hermes-convention template (the Qwen family's), down to the token ids."""

from __future__ import annotations

import json
import shutil

import pytest

from colibrid.engine.text.tokenizer import Tokenizer
from tests.hermes_template import HERMES_TEMPLATE, TOOL_CONVERSATION, WEATHER_TOOL

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hermes_dir(bytelevel_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("hermes") / "tokenizer"
    shutil.copytree(bytelevel_dir, directory)
    (directory / "chat_template.jinja").write_text(HERMES_TEMPLATE)  # the file wins over the config's entry
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    return directory


def _with_dict_arguments(messages):
    """The conversation as transformers documents tool calls: arguments a map, not a JSON string."""
    converted = []
    for message in messages:
        calls = [{**call, "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])}}
                 for call in message.get("tool_calls") or []]
        converted.append({**message, "tool_calls": calls} if calls else message)
    return converted


@pytest.mark.parametrize("arguments_as", ["json string", "map"])
def test_tools_and_tool_calls_render_and_encode_as_transformers_does(hermes_dir, arguments_as):
    messages = TOOL_CONVERSATION if arguments_as == "json string" else _with_dict_arguments(TOOL_CONVERSATION)
    theirs = transformers.AutoTokenizer.from_pretrained(str(hermes_dir))
    ours = Tokenizer.from_dir(hermes_dir)
    want_text = theirs.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in want_text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in want_text
    assert "<tool_response>\n{\"temp_c\": 21}\n</tool_response>" in want_text
    assert ours.apply_chat_template(messages, tools=[WEATHER_TOOL]) == want_text
    want_ids = theirs.apply_chat_template(messages, tools=[WEATHER_TOOL], tokenize=True, add_generation_prompt=True,
                                          return_dict=False)
    assert ours.encode_chat(messages, tools=[WEATHER_TOOL]) == list(want_ids)


def test_without_tools_the_template_renders_the_plain_chat(hermes_dir):
    ours = Tokenizer.from_dir(hermes_dir)
    messages = [{"role": "user", "content": "hi"}]
    assert ours.encode_chat(messages, tools=None) == ours.encode_chat(messages, tools=[]) == ours.encode_chat(messages)
    assert "<tools>" not in ours.apply_chat_template(messages)
