"""From a model's text to an OpenAI assistant message: content, reasoning and tool calls.

Each family writes tool calls in its own convention, and the daemon streams that text as it
is; this module reads it back, as it streams. A parser is fed the text piece by piece and
returns Deltas (content, reasoning, a whole tool call) as soon as it knows what they are:

  - MarkedToolCalls: ordinary text with tool-call blocks opened by a marker. Text is content
    until a marker appears; everything from the marker on is held and parsed at the end.
      Hermes (Qwen family):  <tool_call>{"name": ..., "arguments": {...}}</tool_call>
      GLM-4.5:               <tool_call>NAME<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>
      DeepSeek V3 / R1:      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
                             ```json ARGS ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
      DeepSeek V3.1:         <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>
      Kimi K2:               <|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>ARGS
                             <|tool_call_end|>
  - HarmonyOutput (gpt-oss): the whole answer is messages on channels, written with special
    tokens: `<|channel|>analysis<|message|>...<|end|>` is reasoning, `final` is content, and a
    message whose header names `to=functions.NAME` is a call with JSON arguments.

A tool call's `arguments` is always a JSON string, as the OpenAI API defines it (a model may
write a map; clients such as the openai SDK break on anything but a string).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Callable, Literal

DeltaKind = Literal["content", "reasoning", "tool_call"]


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Delta:
    kind: DeltaKind
    text: str = ""
    call: ToolCall | None = None


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def arguments_json(arguments: object) -> str:
    """OpenAI's `arguments`: a JSON string. A string the model wrote that already is JSON stays as
    written; anything else (a map, a bare word) is encoded."""
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
            return arguments
        except ValueError:
            return json.dumps(arguments, ensure_ascii=False)
    return json.dumps({} if arguments is None else arguments, ensure_ascii=False)


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the beginning of a marker (to hold back)."""
    longest = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-length:]):
                longest = length
                break
    return longest


# --------------------------------------------------------------------------------------------
# Blocks opened by a marker
# --------------------------------------------------------------------------------------------


def _json_value(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _tool_call_tag_blocks(text: str) -> tuple[list[ToolCall], str]:
    """<tool_call>...</tool_call> blocks (the last may be cut off by the end of the answer):
    JSON (Hermes) or NAME + <arg_key>/<arg_value> pairs (GLM-4.5). Returns (calls, other text)."""
    calls, rest = [], []
    for match in re.finditer(r"<tool_call>(.*?)(?:</tool_call>|\Z)|(.+?)(?=<tool_call>|\Z)", text, re.DOTALL):
        if match.group(2) is not None:
            rest.append(match.group(2))
            continue
        body = match.group(1).strip()
        if body.startswith("{"):
            value = _json_value(body)
            if isinstance(value, dict) and isinstance(value.get("name"), str):
                calls.append(ToolCall(new_call_id(), value["name"], arguments_json(value.get("arguments",
                                                                                              value.get("parameters")))))
                continue
        elif body:
            name, _, arguments = body.partition("<arg_key>")
            pairs = re.findall(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", "<arg_key>" + arguments,
                               re.DOTALL) if arguments else []
            if name.strip() and "\n" not in name.strip():
                args = {key.strip(): _json_value(value) for key, value in pairs}
                calls.append(ToolCall(new_call_id(), name.strip(), json.dumps(args, ensure_ascii=False)))
                continue
        rest.append(match.group(0))  # not a call after all: the model's text, as written
    return calls, "".join(rest)


DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DEEPSEEK_CALL_BEGIN, DEEPSEEK_CALL_END, DEEPSEEK_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def _deepseek_blocks(text: str) -> tuple[list[ToolCall], str]:
    calls, rest = [], text
    for body in re.findall(re.escape(DEEPSEEK_CALL_BEGIN) + r"(.*?)(?:" + re.escape(DEEPSEEK_CALL_END) + r"|\Z)",
                           text, re.DOTALL):
        head, separator, tail = body.partition(DEEPSEEK_SEP)
        if not separator:
            continue
        if head.strip() == "function":  # V3 / R1: the name, then the arguments in a ```json fence
            name, _, arguments = tail.partition("\n")
            fenced = re.search(r"```(?:json)?\s*(.*?)\s*(?:```|\Z)", arguments, re.DOTALL)
            arguments = fenced.group(1) if fenced else arguments
        else:  # V3.1: NAME<sep>ARGS
            name, arguments = head, tail
        calls.append(ToolCall(new_call_id(), name.strip(), arguments_json(_json_value(arguments.strip()))))
    rest = re.sub(re.escape(DEEPSEEK_CALLS_BEGIN) + r".*", "", text, flags=re.DOTALL)
    rest = re.sub(re.escape(DEEPSEEK_CALL_BEGIN) + r".*", "", rest, flags=re.DOTALL)
    return calls, rest


KIMI_SECTION_BEGIN, KIMI_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN, KIMI_ARGUMENTS, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def _kimi_blocks(text: str) -> tuple[list[ToolCall], str]:
    calls = []
    pattern = re.escape(KIMI_CALL_BEGIN) + r"(.*?)" + re.escape(KIMI_ARGUMENTS) + r"(.*?)(?:" + \
        re.escape(KIMI_CALL_END) + r"|\Z)"
    for function_id, arguments in re.findall(pattern, text, re.DOTALL):
        name = function_id.strip().removeprefix("functions.").rsplit(":", 1)[0]  # functions.NAME:INDEX
        calls.append(ToolCall(new_call_id(), name, arguments_json(_json_value(arguments.strip()))))
    rest = re.sub("(" + re.escape(KIMI_SECTION_BEGIN) + "|" + re.escape(KIMI_CALL_BEGIN) + ").*", "", text,
                  flags=re.DOTALL)
    return calls, rest


# The marker that opens a family's tool calls, and how its held text is parsed.
BLOCK_PARSERS: dict[str, Callable[[str], tuple[list[ToolCall], str]]] = {
    "<tool_call>": _tool_call_tag_blocks,
    DEEPSEEK_CALLS_BEGIN: _deepseek_blocks,
    DEEPSEEK_CALL_BEGIN: _deepseek_blocks,
    KIMI_SECTION_BEGIN: _kimi_blocks,
    KIMI_CALL_BEGIN: _kimi_blocks,
}


class PlainOutput:
    """No tool calls expected: all text is content."""

    def feed(self, text: str) -> list[Delta]:
        return [Delta("content", text)] if text else []

    def finish(self) -> list[Delta]:
        return []


class MarkedToolCalls:
    """Content until a tool-call marker; from the marker on, held and parsed at the end."""

    def __init__(self, parsers: dict[str, Callable[[str], tuple[list[ToolCall], str]]] | None = None) -> None:
        self._parsers = BLOCK_PARSERS if parsers is None else parsers
        self._markers = tuple(self._parsers)
        self._pending = ""  # text that may be the start of a marker
        self._held: str | None = None  # everything from the first marker on
        self._marker = ""

    def feed(self, text: str) -> list[Delta]:
        if self._held is not None:
            self._held += text
            return []
        text = self._pending + text
        found = [(text.find(marker), marker) for marker in self._markers if marker in text]
        if found:
            position, self._marker = min(found)
            self._held, self._pending = text[position:], ""
            return [Delta("content", text[:position])] if position else []
        keep = _partial_suffix(text, self._markers)
        self._pending = text[len(text) - keep:] if keep else ""
        emitted = text[: len(text) - keep]
        return [Delta("content", emitted)] if emitted else []

    def finish(self) -> list[Delta]:
        if self._held is None:
            return [Delta("content", self._pending)] if self._pending else []
        calls, rest = self._parsers[self._marker](self._held)
        deltas = [Delta("content", rest)] if rest.strip() or not calls else []
        return deltas + [Delta("tool_call", call=call) for call in calls]


# --------------------------------------------------------------------------------------------
# Harmony (gpt-oss)
# --------------------------------------------------------------------------------------------

HARMONY_MESSAGE = "<|message|>"
HARMONY_MESSAGE_ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
HARMONY_SPECIALS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", *HARMONY_MESSAGE_ENDS[:3])


class HarmonyOutput:
    """Messages on channels: analysis is reasoning, final (and a commentary preamble) content,
    a message addressed `to=functions.NAME` a tool call. Needs the special tokens' text
    (ask with `special_tokens`)."""

    def __init__(self) -> None:
        self._buffer = ""
        self._in_body = False  # between <|message|> and the message's end
        self._header = ""  # the current message's header: `<|channel|>final`, `... to=functions.f ...`
        self._body = ""  # a tool call's arguments so far
        self._seen_message = False

    def feed(self, text: str) -> list[Delta]:
        self._buffer += text
        deltas: list[Delta] = []
        while True:
            if not self._in_body:
                position = self._buffer.find(HARMONY_MESSAGE)
                if position < 0:
                    return deltas
                self._header, self._buffer = self._buffer[:position], self._buffer[position + len(HARMONY_MESSAGE):]
                self._in_body, self._seen_message, self._body = True, True, ""
                continue
            ends = [(self._buffer.find(end), end) for end in HARMONY_MESSAGE_ENDS if end in self._buffer]
            if ends:
                position, end = min(ends)
                deltas += self._body_text(self._buffer[:position], final=True)
                self._buffer = self._buffer[position + (0 if end == "<|start|>" else len(end)):]
                self._in_body = False
                continue
            keep = _partial_suffix(self._buffer, HARMONY_SPECIALS)
            deltas += self._body_text(self._buffer[: len(self._buffer) - keep], final=False)
            self._buffer = self._buffer[len(self._buffer) - keep:]
            return deltas

    def finish(self) -> list[Delta]:
        if self._in_body:  # the end token (<|call|>, <|return|>) is end-of-sequence: its text is never sent
            deltas = self._body_text(self._buffer, final=True)
        elif not self._seen_message:  # no Harmony structure at all: show what the model wrote
            deltas = [Delta("content", self._buffer)] if self._buffer else []
        else:
            deltas = []
        self._buffer, self._in_body = "", False
        return deltas

    def _body_text(self, text: str, final: bool) -> list[Delta]:
        recipient = re.search(r"to=(\S+?)(?:<\||\s|$)", self._header)
        if recipient and recipient.group(1).startswith("functions."):
            self._body += text
            if not final:
                return []
            name = recipient.group(1).removeprefix("functions.")
            return [Delta("tool_call", call=ToolCall(new_call_id(), name, arguments_json(_json_value(self._body.strip()))))]
        channel = re.search(r"<\|channel\|>\s*(\w+)", self._header)
        kind: DeltaKind = "reasoning" if channel and channel.group(1) == "analysis" else "content"
        return [Delta(kind, text)] if text else []


FORMATS = ("auto", "hermes", "harmony", "deepseek", "kimi", "none")
# Families whose answers are Harmony messages, by the architecture colibrid reports.
HARMONY_ARCHITECTURES = frozenset({"gpt_oss"})


def resolve_format(configured: str, architecture: str) -> str:
    """The format to parse: the configured one, or for "auto" the family's ("harmony" for gpt-oss,
    otherwise "marked": any of the marker conventions, recognised by their markers)."""
    if configured != "auto":
        return configured
    return "harmony" if architecture in HARMONY_ARCHITECTURES else "marked"


def new_parser(output_format: str, tools_given: bool):
    """A fresh parser for one answer in `output_format` (see resolve_format)."""
    if output_format == "harmony":
        return HarmonyOutput()
    if not tools_given or output_format == "none":
        return PlainOutput()
    if output_format == "hermes":
        return MarkedToolCalls({"<tool_call>": _tool_call_tag_blocks})
    if output_format == "deepseek":
        return MarkedToolCalls({DEEPSEEK_CALLS_BEGIN: _deepseek_blocks, DEEPSEEK_CALL_BEGIN: _deepseek_blocks})
    if output_format == "kimi":
        return MarkedToolCalls({KIMI_SECTION_BEGIN: _kimi_blocks, KIMI_CALL_BEGIN: _kimi_blocks})
    return MarkedToolCalls()


def needs_special_tokens(output_format: str, tools_given: bool) -> bool:
    """Harmony's structure is special tokens; other families' tool-call markers may be too."""
    return output_format == "harmony" or (tools_given and output_format != "none")
