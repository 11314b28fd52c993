"""Requests (docs/protocol.md, Requests and events): what a client sends, as typed values.

Two ends use them. The daemon turns a decoded frame into a typed request with parse_request -
or a ProtocolError whose code is one of the codes in docs/protocol.md; every check of a
client's fields is here, apart from the server, so tests can hold them against the document.
A client builds a request value and sends its to_wire() map: hello, cancel, subscribe,
status, models and verify are the same values on both ends; an ask is written as AskFields
(only what the client sets: the daemon's defaults fill the rest) and read as an Ask, whose
sampling parameters the daemon has resolved.

Pure: no sockets, no engine.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Union

from colibrid.wire.errors import ProtocolError, RequestId
from colibrid.wire.frames import PROTOCOL_VERSION
from colibrid.wire.sampling_params import SamplingParams  # a plain value type: the protocol imports no engine
from colibrid.wire.values import is_int, is_number

# The longest string id a request may carry, in UTF-8 bytes. Every event of a request repeats
# its id, so without a bound one 900 kB id in an ask becomes hundreds of MB of token events.
MAX_ID_BYTES = 256

# Tool calling (an ask's `tools`, an assistant message's `tool_calls`): how many, and how deeply
# nested their JSON may be. The frame size already bounds their bytes; these bound the work a
# chat template does walking them (and keep the checks below from recursing without end).
MAX_TOOLS = 128
MAX_TOOL_CALLS_PER_MESSAGE = 64
MAX_JSON_DEPTH = 16


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    id: RequestId
    protocol: int
    client: str | None

    def to_wire(self) -> dict[str, Any]:
        message = {"op": "hello", "id": self.id, "protocol": self.protocol}
        if self.client is not None:
            message["client"] = self.client
        return message


@dataclass(frozen=True)
class Ask:
    """An ask as the daemon accepted it: its sampling parameters resolved against the daemon's
    defaults (a client writes AskFields)."""

    id: RequestId
    prompt: str | None
    messages: list[dict[str, str]] | None
    system: str | None
    raw: bool
    params: SamplingParams
    tools: list[dict[str, Any]] | None = None  # function descriptions for the chat template
    debug_routing: bool = False  # each token event carries the experts that produced it


@dataclass(frozen=True)
class Cancel:
    id: RequestId
    target: RequestId

    def to_wire(self) -> dict[str, Any]:
        return {"op": "cancel", "id": self.id, "target": self.target}


@dataclass(frozen=True)
class Subscribe:
    id: RequestId
    stream: str

    def to_wire(self) -> dict[str, Any]:
        return {"op": "subscribe", "id": self.id, "stream": self.stream}


@dataclass(frozen=True)
class Status:
    id: RequestId

    def to_wire(self) -> dict[str, Any]:
        return {"op": "status", "id": self.id}


@dataclass(frozen=True)
class Models:
    id: RequestId

    def to_wire(self) -> dict[str, Any]:
        return {"op": "models", "id": self.id}


@dataclass(frozen=True)
class Verify:
    """Check the whole pack (docs/protocol.md, `verify`): in the foreground (events until
    `verified`), in the background (`ok` at once), or ``stop`` the one running."""

    id: RequestId
    background: bool = False
    max_mb_per_s: float | None = None  # a bandwidth cap; None: the default (background) or none
    stop: bool = False

    def to_wire(self) -> dict[str, Any]:
        message: dict[str, Any] = {"op": "verify", "id": self.id}
        if self.background:
            message["background"] = True
        if self.stop:
            message["stop"] = True
        if self.max_mb_per_s is not None:
            message["max_mb_per_s"] = self.max_mb_per_s
        return message


Request = Union[Hello, Ask, Cancel, Subscribe, Status, Models, Verify]


@dataclass(frozen=True)
class AskFields:
    """An ask as a client writes it: only the fields it sets are sent (a flag only when true), so
    the daemon's defaults - documented in one place, the daemon's config - fill the rest. Not
    checked here: the daemon's parse_request is the one check of a client's fields."""

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    system: str | None = None
    raw: bool = False
    tools: list[dict[str, Any]] | None = None
    special_tokens: bool = False
    max_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    logprobs: int | None = None
    ignore_eos: bool = False
    debug_routing: bool = False

    def to_wire(self, request_id: RequestId) -> dict[str, Any]:
        """The ask request with id ``request_id``."""
        message: dict[str, Any] = {"op": "ask", "id": request_id}
        for field in fields(self):
            value = getattr(self, field.name)
            if value is not None and value is not False:
                message[field.name] = value
        return message


MAX_VERIFY_MB_PER_S = 1e6  # a cap above any disk is no cap: refused as a likely mistake

# The streams a client may subscribe to.
STREAMS = ("routing",)

_MISSING = object()


def is_request_id(value: Any) -> bool:
    """A string of at most MAX_ID_BYTES (UTF-8) or an integer (msgpack bounds it to 64 bits)."""
    if isinstance(value, str):
        # Characters first: a long string is refused without encoding it.
        return len(value) <= MAX_ID_BYTES and len(value.encode("utf-8", "surrogatepass")) <= MAX_ID_BYTES
    return is_int(value)


def is_json_value(value: Any, max_depth: int = MAX_JSON_DEPTH) -> bool:
    """JSON data (nil, bool, number, string, list, map with string keys) nested at most max_depth deep.
    Iterative: a hostile nesting cannot exhaust the stack."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if item is None or isinstance(item, (bool, int, float, str)):
            continue
        if depth > max_depth:
            return False
        if isinstance(item, list):
            pending.extend((element, depth + 1) for element in item)
        elif isinstance(item, dict) and all(isinstance(key, str) for key in item):
            pending.extend((element, depth + 1) for element in item.values())
        else:
            return False
    return True


def _is_tool_call(value: Any) -> bool:
    """{"id"?, "type"?, "function": {"name": str, "arguments": str or map}}, as OpenAI sends them back."""
    if not isinstance(value, dict) or not is_json_value(value):
        return False
    function = value.get("function")
    return (isinstance(function, dict) and isinstance(function.get("name"), str)
            and isinstance(function.get("arguments", ""), (str, dict))
            and all(isinstance(value.get(key, ""), str) for key in ("id", "type")))


# The keys a chat message may hold besides `role`, and the type each must have.
_MESSAGE_FIELD_TYPES = {
    "content": lambda v: isinstance(v, str),
    "tool_calls": lambda v: (isinstance(v, list) and len(v) <= MAX_TOOL_CALLS_PER_MESSAGE
                             and all(_is_tool_call(call) for call in v)),
    "tool_call_id": lambda v: isinstance(v, str),  # a `tool` message answers this call
    "name": lambda v: isinstance(v, str),
    "reasoning_content": lambda v: isinstance(v, str),
}


def _is_message(value: Any) -> bool:
    """A map with `role` and `content` strings; an assistant message with `tool_calls` may have no
    `content` (or nil). nil-valued optional keys mean absent, as everywhere in a request."""
    if not isinstance(value, dict) or not isinstance(value.get("role"), str):
        return False
    fields = {key: field for key, field in value.items() if key != "role" and field is not None}
    if "content" not in fields and "tool_calls" not in fields:
        return False
    return all(key in _MESSAGE_FIELD_TYPES and _MESSAGE_FIELD_TYPES[key](field) for key, field in fields.items())


def _is_message_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_message(m) for m in value)


def _is_tool_list(value: Any) -> bool:
    return (isinstance(value, list) and len(value) <= MAX_TOOLS
            and all(isinstance(tool, dict) and is_json_value(tool) for tool in value))


def _is_string_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(s, str) for s in value)


# Optional ask fields: the type each must have and what the error calls it. nil means absent.
_ASK_FIELD_TYPES = {
    "prompt": (lambda v: isinstance(v, str), "a string"),
    "messages": (_is_message_list, "a list of {role, content} maps of strings (tool_calls, tool_call_id, name, "
                                   "reasoning_content optional)"),
    "tools": (_is_tool_list, f"a list of at most {MAX_TOOLS} maps of JSON data nested at most {MAX_JSON_DEPTH} deep"),
    "special_tokens": (lambda v: isinstance(v, bool), "a boolean"),
    "system": (lambda v: isinstance(v, str), "a string"),
    "raw": (lambda v: isinstance(v, bool), "a boolean"),
    "max_tokens": (is_int, "an integer"),
    "temperature": (is_number, "a number"),
    "top_p": (is_number, "a number"),
    "min_p": (is_number, "a number"),
    "repetition_penalty": (is_number, "a number"),
    "top_k": (is_int, "an integer"),
    "seed": (is_int, "an integer"),
    "stop": (_is_string_list, "a list of strings"),
    "logprobs": (is_int, "an integer"),
    "ignore_eos": (lambda v: isinstance(v, bool), "a boolean"),
    "debug_routing": (lambda v: isinstance(v, bool), "a boolean"),
}
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "min_p", "repetition_penalty", "top_k", "seed", "stop",
                    "logprobs", "ignore_eos")


def usable_id(message: dict[str, Any]) -> RequestId | None:
    """The `id` of a request map if a reply may carry it, else None: for the error that refuses
    a request before it is parsed (its sender is not allowed in, say)."""
    request_id = message.get("id")
    return request_id if is_request_id(request_id) else None


def parse_request(message: dict[str, Any], default_max_tokens: int,
                  sampling_defaults: dict[str, Any] | None = None, greeted: bool = True) -> Request:
    """A typed request from a decoded frame; ProtocolError (with the id when known) if it is not one.
    ``sampling_defaults`` (the model's generation_config.json) fill the sampling fields an ask omits;
    until a connection is ``greeted``, only a hello is a request."""
    if not greeted and message.get("op") != "hello":
        raise ProtocolError("bad_request", "the first request on a connection must be hello", usable_id(message))
    request_id = message.get("id", _MISSING)
    if request_id is _MISSING or not is_request_id(request_id):
        raise ProtocolError("bad_request", f"every request needs an `id`: a string of at most {MAX_ID_BYTES} "
                                           "bytes or an integer")
    op = message.get("op", _MISSING)
    if not isinstance(op, str):
        raise ProtocolError("bad_request", "every request needs an `op` string", request_id)
    parser = _PARSERS.get(op)
    if parser is None:
        raise ProtocolError("unknown_op", f"unknown op {op!r}; ops are {', '.join(_PARSERS)}", request_id)
    if parser is _parse_ask:
        return _parse_ask(message, request_id, default_max_tokens, sampling_defaults or {})
    return parser(message, request_id)


def _parse_hello(message: dict[str, Any], request_id: RequestId) -> Hello:
    protocol = message.get("protocol", _MISSING)
    if not is_int(protocol):
        raise ProtocolError("bad_request", "hello needs `protocol`: an integer", request_id)
    if protocol != PROTOCOL_VERSION:
        raise ProtocolError("unsupported_protocol",
                            f"this server speaks protocol {PROTOCOL_VERSION}, not {protocol}", request_id)
    client = message.get("client")
    if client is not None and not isinstance(client, str):
        raise ProtocolError("bad_request", "hello `client` must be a string", request_id)
    return Hello(request_id, protocol, client)


def _parse_ask(message: dict[str, Any], request_id: RequestId, default_max_tokens: int,
               sampling_defaults: dict[str, Any]) -> Ask:
    fields = {name: message.get(name) for name in _ASK_FIELD_TYPES}
    for name, (has_type, type_name) in _ASK_FIELD_TYPES.items():
        if fields[name] is not None and not has_type(fields[name]):
            raise ProtocolError("bad_request", f"ask `{name}` must be {type_name}", request_id)
    if (fields["prompt"] is None) == (fields["messages"] is None):
        raise ProtocolError("bad_request", "ask needs exactly one of `prompt` and `messages`", request_id)
    sampling = {"max_tokens": default_max_tokens, **sampling_defaults,
                **{name: fields[name] for name in _SAMPLING_FIELDS if fields[name] is not None}}
    try:
        # The one check of a client's parameters: built valid or not at all.
        params = SamplingParams(**sampling, skip_special_tokens=not fields["special_tokens"])
    except ValueError as exc:
        raise ProtocolError("invalid_params", str(exc), request_id) from None
    if fields["tools"] and fields["raw"]:
        raise ProtocolError("invalid_params", "`tools` go through the chat template; a `raw` ask has none",
                            request_id)
    return Ask(request_id, fields["prompt"], fields["messages"], fields["system"], bool(fields["raw"]), params,
               fields["tools"] or None, bool(fields["debug_routing"]))


def _parse_cancel(message: dict[str, Any], request_id: RequestId) -> Cancel:
    target = message.get("target", _MISSING)
    if not is_request_id(target):
        raise ProtocolError("bad_request", "cancel needs `target`: the id (string of at most "
                                           f"{MAX_ID_BYTES} bytes, or integer) of an open ask",
                            request_id)
    return Cancel(request_id, target)


def _parse_subscribe(message: dict[str, Any], request_id: RequestId) -> Subscribe:
    stream = message.get("stream")
    if not isinstance(stream, str):
        raise ProtocolError("bad_request", "subscribe needs `stream`: a string", request_id)
    if stream not in STREAMS:
        raise ProtocolError("invalid_params", f"no stream {stream[:64]!r}; streams are {', '.join(STREAMS)}",
                            request_id)
    return Subscribe(request_id, stream)


def _parse_status(message: dict[str, Any], request_id: RequestId) -> Status:
    return Status(request_id)


def _parse_models(message: dict[str, Any], request_id: RequestId) -> Models:
    return Models(request_id)


def _parse_verify(message: dict[str, Any], request_id: RequestId) -> Verify:
    background, stop, cap = message.get("background"), message.get("stop"), message.get("max_mb_per_s")
    for name, value in (("background", background), ("stop", stop)):
        if value is not None and not isinstance(value, bool):
            raise ProtocolError("bad_request", f"verify `{name}` must be a boolean", request_id)
    if cap is not None and not is_number(cap):
        raise ProtocolError("bad_request", "verify `max_mb_per_s` must be a number", request_id)
    if cap is not None and not 0 < cap <= MAX_VERIFY_MB_PER_S:
        raise ProtocolError("invalid_params", f"verify `max_mb_per_s` must be in (0, {MAX_VERIFY_MB_PER_S:g}]",
                            request_id)
    return Verify(request_id, bool(background), None if cap is None else float(cap), bool(stop))


_PARSERS = {"hello": _parse_hello, "ask": _parse_ask, "cancel": _parse_cancel, "subscribe": _parse_subscribe,
            "status": _parse_status, "models": _parse_models, "verify": _parse_verify}


