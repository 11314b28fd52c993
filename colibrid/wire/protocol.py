"""The wire protocol (docs/protocol.md): frames, typed requests, and the events the server sends.

A frame is a 4-byte big-endian length N and N bytes of one msgpack map with string keys.
This module is pure: no sockets, no engine. It turns bytes into typed requests - or a
ProtocolError whose code is one of the codes in docs/protocol.md - and events into bytes.
Keeping the checks here, apart from the server, lets tests hold them against the document.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, Union

import msgpack

from colibrid import __version__
from colibrid.wire.sampling_params import SamplingParams  # a plain value type: the protocol imports no engine

PROTOCOL_VERSION = 1
SERVER_NAME = f"colibrid {__version__}"
LENGTH_PREFIX = struct.Struct(">I")  # N, the body length in bytes

# Errors after which the server cannot trust the byte stream or the client, so it closes the
# connection; every other error ends only the request it names.
CONNECTION_CLOSING_CODES = frozenset({"bad_frame", "frame_too_large", "bad_request", "unknown_op",
                                      "unsupported_protocol", "forbidden", "timeout"})

RequestId = Union[str, int]

# The longest string id a request may carry, in UTF-8 bytes. Every event of a request repeats
# its id, so without a bound one 900 kB id in an ask becomes hundreds of MB of token events.
MAX_ID_BYTES = 256

# Tool calling (an ask's `tools`, an assistant message's `tool_calls`): how many, and how deeply
# nested their JSON may be. The frame size already bounds their bytes; these bound the work a
# chat template does walking them (and keep the checks below from recursing without end).
MAX_TOOLS = 128
MAX_TOOL_CALLS_PER_MESSAGE = 64
MAX_JSON_DEPTH = 16


class ProtocolError(Exception):
    """A request or frame the server refuses; `code` is a protocol error code."""

    def __init__(self, code: str, message: str, request_id: RequestId | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id

    @property
    def closes_connection(self) -> bool:
        return self.code in CONNECTION_CLOSING_CODES


# --------------------------------------------------------------------------------------------
# Framing
# --------------------------------------------------------------------------------------------


def encode_frame(message: dict[str, Any]) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return LENGTH_PREFIX.pack(len(body)) + body


def body_length(prefix: bytes, max_frame_bytes: int) -> int:
    """The body length announced by a 4-byte prefix; checked before a byte of the body is read."""
    (length,) = LENGTH_PREFIX.unpack(prefix)
    if length == 0:
        raise ProtocolError("bad_frame", "zero-length frame: a frame holds one msgpack map")
    if length > max_frame_bytes:
        raise ProtocolError("frame_too_large", f"frame of {length} bytes is above max_frame_bytes ({max_frame_bytes})")
    return length


def decode_body(body: bytes) -> dict[str, Any]:
    """The one msgpack map with string keys that `body` must hold."""
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for malformed input
        raise ProtocolError("bad_frame", f"frame body is not one msgpack object ({type(exc).__name__})") from None
    if not isinstance(message, dict) or not all(isinstance(key, str) for key in message):
        raise ProtocolError("bad_frame", "frame body must be a msgpack map with string keys")
    return message


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    id: RequestId
    protocol: int
    client: str | None


@dataclass(frozen=True)
class Ask:
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


@dataclass(frozen=True)
class Subscribe:
    id: RequestId
    stream: str


@dataclass(frozen=True)
class Status:
    id: RequestId


@dataclass(frozen=True)
class Models:
    id: RequestId


@dataclass(frozen=True)
class Verify:
    """Check the whole pack (docs/protocol.md, `verify`): in the foreground (events until
    `verified`), in the background (`ok` at once), or ``stop`` the one running."""

    id: RequestId
    background: bool = False
    max_mb_per_s: float | None = None  # a bandwidth cap; None: the default (background) or none
    stop: bool = False


Request = Union[Hello, Ask, Cancel, Subscribe, Status, Models, Verify]

MAX_VERIFY_MB_PER_S = 1e6  # a cap above any disk is no cap: refused as a likely mistake

# The streams a client may subscribe to.
STREAMS = ("routing",)

_MISSING = object()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_request_id(value: Any) -> bool:
    """A string of at most MAX_ID_BYTES (UTF-8) or an integer (msgpack bounds it to 64 bits)."""
    if isinstance(value, str):
        # Characters first: a long string is refused without encoding it.
        return len(value) <= MAX_ID_BYTES and len(value.encode("utf-8", "surrogatepass")) <= MAX_ID_BYTES
    return _is_int(value)


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
    "max_tokens": (_is_int, "an integer"),
    "temperature": (_is_number, "a number"),
    "top_p": (_is_number, "a number"),
    "min_p": (_is_number, "a number"),
    "repetition_penalty": (_is_number, "a number"),
    "top_k": (_is_int, "an integer"),
    "seed": (_is_int, "an integer"),
    "stop": (_is_string_list, "a list of strings"),
    "logprobs": (_is_int, "an integer"),
    "ignore_eos": (lambda v: isinstance(v, bool), "a boolean"),
    "debug_routing": (lambda v: isinstance(v, bool), "a boolean"),
}
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "min_p", "repetition_penalty", "top_k", "seed", "stop",
                    "logprobs", "ignore_eos")


def parse_request(message: dict[str, Any], default_max_tokens: int,
                  sampling_defaults: dict[str, Any] | None = None) -> Request:
    """A typed request from a decoded frame; ProtocolError (with the id when known) if it is not one.
    ``sampling_defaults`` (the model's generation_config.json) fill the sampling fields an ask omits."""
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
    if not _is_int(protocol):
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
    if cap is not None and not _is_number(cap):
        raise ProtocolError("bad_request", "verify `max_mb_per_s` must be a number", request_id)
    if cap is not None and not 0 < cap <= MAX_VERIFY_MB_PER_S:
        raise ProtocolError("invalid_params", f"verify `max_mb_per_s` must be in (0, {MAX_VERIFY_MB_PER_S:g}]",
                            request_id)
    return Verify(request_id, bool(background), None if cap is None else float(cap), bool(stop))


_PARSERS = {"hello": _parse_hello, "ask": _parse_ask, "cancel": _parse_cancel, "subscribe": _parse_subscribe,
            "status": _parse_status, "models": _parse_models, "verify": _parse_verify}


# --------------------------------------------------------------------------------------------
# Events
# --------------------------------------------------------------------------------------------


def error_event(request_id: RequestId | None, code: str, message: str,
                damage: dict[str, Any] | None = None) -> dict[str, Any]:
    """An `error`; ``damage`` (code `pack_damaged`): the damaged expert record the request needed."""
    event = {"event": "error", "id": request_id, "code": code, "message": message}
    if damage is not None:
        event["damage"] = damage
    return event



def hello_event(request_id: RequestId, model_name: str, max_frame_bytes: int) -> dict[str, Any]:
    return {"event": "hello", "id": request_id, "protocol": PROTOCOL_VERSION, "server": SERVER_NAME,
            "model": model_name, "max_frame_bytes": max_frame_bytes}


def ok_event(request_id: RequestId) -> dict[str, Any]:
    """The reply to a `cancel`: the target ends with its own `done`."""
    return {"event": "ok", "id": request_id}


def models_event(request_id: RequestId, models: list[dict[str, Any]]) -> dict[str, Any]:
    return {"event": "models", "id": request_id, "models": models}


def status_event(request_id: RequestId, daemon_status: dict[str, Any]) -> dict[str, Any]:
    """The `status` event: the daemon's view of itself (docs/protocol.md lists the fields)."""
    return {"event": "status", "id": request_id, **daemon_status}


def token_event(request_id: RequestId, token: Any, token_text: Callable[[int], str] | None = None,
                routing: dict[str, Any] | None = None) -> dict[str, Any]:
    """A `token` event for one sampled token: the engine's GenerationEvent (token_id, text,
    logprob, top_logprobs). With ``token_text`` (the request asked for logprobs), the event
    carries the token's logprob and its alternatives as [id, text, logprob]; with ``routing``
    (debug_routing, see token_routing) the experts that produced it."""
    event: dict[str, Any] = {"event": "token", "id": request_id, "token_ids": [token.token_id], "text": token.text}
    if token_text is not None:
        event["logprob"] = token.logprob
        event["top_logprobs"] = [[token_id, token_text(token_id), logprob]
                                 for token_id, logprob in (token.top_logprobs or [])]
    if routing is not None:
        event["routing"] = routing
    return event


def token_routing(step: int, layers: list[int], experts: list[list[int]], weights: list[list[float]]) -> dict[str, Any]:
    """A token event's `routing`: in step ``step``, the experts (best first) and their mixing
    weights that each MoE layer chose for the position whose logits the token was sampled from."""
    return {"step": step, "layers": layers, "experts": experts, "weights": weights}


def subscribed_event(request_id: RequestId, stream: str, moe_layers: list[int], num_experts: int,
                     experts_per_token: int) -> dict[str, Any]:
    """The first event of a subscription: the model's routing shape, for drawing what follows."""
    return {"event": "subscribed", "id": request_id, "stream": stream, "moe_layers": moe_layers,
            "num_experts": num_experts, "experts_per_token": experts_per_token}


def routing_layer_summary(layer: int, experts: list[int], counts: list[int], hits: int | None,
                          misses: int | None) -> dict[str, Any]:
    """One MoE layer in a `routing` event: the experts the step's rows chose (increasing), how
    many rows chose each, and the expert cache's hits and misses in the step (nil: no cache)."""
    return {"layer": layer, "experts": experts, "counts": counts, "hits": hits, "misses": misses}


def routing_event(request_id: RequestId, step: int, step_ms: float, rows: int, sequences: int,
                  layers: list[dict[str, Any]], dropped: int) -> dict[str, Any]:
    """One step's routing summary for a subscriber; ``dropped``: summaries it missed before this one."""
    return {"event": "routing", "id": request_id, "step": step, "step_ms": step_ms, "rows": rows,
            "sequences": sequences, "layers": layers, "dropped": dropped}


def unsubscribed_event(request_id: RequestId, reason: str) -> dict[str, Any]:
    """The last event of a subscription: "cancelled" or "shutdown"."""
    return {"event": "unsubscribed", "id": request_id, "reason": reason}


def done_event(request_id: RequestId, done: Any, expert_hits: int = 0, expert_misses: int = 0) -> dict[str, Any]:
    """The `done` event ending a request: the engine's GenerationDone (finish_reason, text and
    counts) and the expert cache's hits and misses in the steps the request took part in."""
    return {
        "event": "done", "id": request_id, "finish_reason": done.finish_reason, "text": done.text,
        "usage": {
            "prompt_tokens": done.prompt_tokens, "cached_prompt_tokens": done.cached_prompt_tokens,
            "generated_tokens": done.generated_tokens,
            "time_to_first_token_ms": done.time_to_first_token_s * 1000.0,
            "decode_tokens_per_s": done.decode_tokens_per_s,
            "expert_cache_hits": expert_hits, "expert_cache_misses": expert_misses,
        },
    }


def cancelled_before_start_event(request_id: RequestId) -> dict[str, Any]:
    """The `done` of an ask cancelled while it still waited in the queue: nothing was generated."""
    return {
        "event": "done", "id": request_id, "finish_reason": "cancelled", "text": "",
        "usage": {"prompt_tokens": 0, "cached_prompt_tokens": 0, "generated_tokens": 0, "time_to_first_token_ms": 0.0,
                  "decode_tokens_per_s": 0.0, "expert_cache_hits": 0, "expert_cache_misses": 0},
    }


def verify_progress_event(request_id: RequestId, progress: dict[str, Any]) -> dict[str, Any]:
    """How far a verify is: bytes_done, bytes_total, elapsed_s, mb_per_s, eta_s, file, paused."""
    return {"event": "verify_progress", "id": request_id, **progress}


def verify_damage_event(request_id: RequestId, damage: dict[str, Any]) -> dict[str, Any]:
    """One finding of a verify: file, message, and where (offset, length, layer, expert, tensor)."""
    return {"event": "verify_damage", "id": request_id, **damage}


def verified_event(request_id: RequestId, report: dict[str, Any]) -> dict[str, Any]:
    """The end of a foreground verify: the whole report (clean, cancelled, damage, notes, files, ...)."""
    return {"event": "verified", "id": request_id, **report}


def shutdown_event(request_id: RequestId) -> dict[str, Any]:
    return error_event(request_id, "shutdown", "colibrid is stopping; the request was not completed")
