"""Tool calls (and Harmony's channels) read back from a model's text, whole and as it streams:
each family's convention, written as the family's chat templates and docs show it."""

from __future__ import annotations

import json

import pytest

from colibrid.gateway.model_output import HarmonyOutput, MarkedToolCalls, new_parser, resolve_format


def _run(parser, pieces):
    deltas = []
    for piece in pieces:
        deltas += parser.feed(piece)
    deltas += parser.finish()
    content = "".join(d.text for d in deltas if d.kind == "content")
    reasoning = "".join(d.text for d in deltas if d.kind == "reasoning")
    calls = [(d.call.name, json.loads(d.call.arguments)) for d in deltas if d.kind == "tool_call"]
    for delta in deltas:
        if delta.kind == "tool_call":
            assert isinstance(delta.call.arguments, str) and delta.call.id.startswith("call_")
    return content, reasoning, calls


def _every_split(parser_factory, text):
    """The result for the whole text, checked to be the same however the text is cut in two or streamed by character."""
    whole = _run(parser_factory(), [text])
    assert _run(parser_factory(), list(text)) == whole
    for cut in range(1, len(text)):
        assert _run(parser_factory(), [text[:cut], text[cut:]]) == whole, cut
    return whole


CASES = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
               "Let me check.\n", [("get_weather", {"city": "Paris"})]),
    "hermes two calls": ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n'
                         '{"name": "b", "arguments": {"x": [1, 2]}}\n</tool_call>',
                         "", [("a", {}), ("b", {"x": [1, 2]})]),
    "hermes cut off at the end": ('<tool_call>\n{"name": "f", "arguments": {"q": "x"}}',
                                  "", [("f", {"q": "x"})]),
    "hermes arguments as a JSON string": ('<tool_call>{"name": "f", "arguments": "{\\"q\\": 1}"}</tool_call>',
                                          "", [("f", {"q": 1})]),
    "glm-4.5": ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
                "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
                "", [("get_weather", {"city": "Paris", "days": 3})]),
    "deepseek v3": ("Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
                    "Sure.", [("get_weather", {"city": "Paris"})]),
    "deepseek v3.1": ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo"}'
                      '<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
                      "", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    "kimi k2": ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
                '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>',
                "", [("get_weather", {"city": "Paris"})]),
    "no call": ("Just text with a < and <tool and {json}.", "Just text with a < and <tool and {json}.", []),
    "not json after all": ("<tool_call>oops", "", [("oops", {})]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_marked_tool_calls_whole_and_streamed(name):
    text, content, calls = CASES[name]
    assert _every_split(MarkedToolCalls, text) == (content, "", calls)


def test_a_marker_followed_by_no_call_is_given_back_as_content():
    text = "Use <tool_call>\nlike this\nplease"  # neither JSON nor a one-line GLM name
    assert _every_split(MarkedToolCalls, text) == (text, "", [])


def test_without_tools_everything_is_content():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert _run(new_parser("marked", tools_given=False), [text]) == (text, "", [])


HARMONY_ANSWER = ("<|channel|>analysis<|message|>The user wants weather.<|end|><|start|>assistant<|channel|>final"
                  "<|message|>It is sunny.")
HARMONY_CALL = ("<|channel|>analysis<|message|>Need the tool.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}')


def test_harmony_reasoning_and_final_answer():
    assert _every_split(HarmonyOutput, HARMONY_ANSWER) == ("It is sunny.", "The user wants weather.", [])


def test_harmony_tool_call_ends_at_the_end_of_the_answer():
    # <|call|> is an end-of-sequence token: colibrid never sends its text.
    assert _every_split(HarmonyOutput, HARMONY_CALL) == ("", "Need the tool.", [("get_weather", {"city": "Paris"})])
    assert _run(HarmonyOutput(), [HARMONY_CALL + "<|call|>"])[2] == [("get_weather", {"city": "Paris"})]


def test_harmony_recipient_in_the_role_part_of_the_header():
    text = '<|channel|>commentary to=functions.lookup<|constrain|>json<|message|>{"q": "x"}<|call|>'
    assert _run(HarmonyOutput(), [text]) == ("", "", [("lookup", {"q": "x"})])


def test_harmony_text_without_channels_is_shown_as_written():
    assert _run(HarmonyOutput(), ["plain words"]) == ("plain words", "", [])


def test_the_format_follows_the_family_unless_configured():
    assert resolve_format("auto", "gpt_oss") == "harmony"
    assert resolve_format("auto", "qwen3_moe") == "marked"
    assert resolve_format("hermes", "gpt_oss") == "hermes"
    hermes_only = new_parser("hermes", tools_given=True)
    assert _run(hermes_only, ['<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}'])[2] == []
