"""Events (docs/protocol.md): what the daemon sends, one frozen value per event.

The daemon builds these values and sends their to_wire() map; a client turns each map it reads
back into one with event_from_wire(). Nothing else builds or reads an event's map, so a field's
name, type and place are written here once. to_wire() gives the keys in the order
docs/protocol.md lists them, the order the daemon has always sent.

A daemon is trusted less than you would think: event_from_wire checks the `event` name, the
`id`, and every field a client reads, and refuses a malformed event with a ProtocolViolation
(never a crash further on). What it does not know it keeps: keys a newer daemon adds go to
`extra` (and back out in to_wire(), after the known ones), an event it has no type for becomes
an UnknownEvent, and `status`, a big open map, is kept whole as a mapping.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from colibrid.wire.errors import ProtocolViolation, RequestId
from colibrid.wire.values import is_int, is_number

# --------------------------------------------------------------------------------------------
# Reading a map: each field checked once, what is left kept
# --------------------------------------------------------------------------------------------


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_map(value: Any) -> bool:
    return isinstance(value, dict)


def _list_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, list) and all(check(item) for item in value)


def _is_alternative(value: Any) -> bool:
    """One of a token's top_logprobs: [token_id, text, logprob]."""
    return (isinstance(value, list) and len(value) == 3 and is_int(value[0]) and _is_str(value[1])
            and is_number(value[2]))


def _is_request_id(value: Any) -> bool:
    return value is None or isinstance(value, str) or is_int(value)


_MISSING = object()


class _Reader:
    """Takes the fields of one map (``where`` names it in errors: "a done event"); what it was
    not asked for is ``extra()``."""

    def __init__(self, message: Mapping[Any, Any], where: str, known: tuple[str, ...] = ()) -> None:
        self._message = message
        self._where = where
        self._taken = set(known)

    def required(self, key: str, check: Callable[[Any], bool], what: str) -> Any:
        self._taken.add(key)
        value = self._message.get(key, _MISSING)
        if value is _MISSING:
            raise ProtocolViolation(f"the daemon sent {self._where} without `{key}`")
        if not check(value):
            raise ProtocolViolation(f"the daemon sent {self._where} whose `{key}` is not {what}: {value!r:.80}")
        return value

    def optional(self, key: str, check: Callable[[Any], bool], what: str, default: Any = None) -> Any:
        """The value, or ``default`` when the key is absent or nil."""
        if self._message.get(key) is None:
            self._taken.add(key)
            return default
        return self.required(key, check, what)

    def extra(self) -> dict[Any, Any]:
        return {key: value for key, value in self._message.items() if key not in self._taken}


# --------------------------------------------------------------------------------------------
# Parts of events
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenRouting:
    """A token event's `routing` (debug_routing): in engine step ``step``, the experts (best
    first) and their mixing weights that each MoE layer chose for the position whose logits
    the token was sampled from."""

    step: int
    layers: list[int]  # (L,) the model's MoE layers, in order
    experts: list[list[int]]  # (L, A) A = experts_per_token
    weights: list[list[float]]  # (L, A)

    def to_wire(self) -> dict[str, Any]:
        return {"step": self.step, "layers": self.layers, "experts": self.experts, "weights": self.weights}

    @classmethod
    def from_wire(cls, message: Mapping[Any, Any]) -> "TokenRouting":
        read = _Reader(message, "a token event's routing")
        return cls(read.required("step", is_int, "an integer"),
                   read.required("layers", _list_of(is_int), "a list of integers"),
                   read.required("experts", _list_of(_list_of(is_int)), "a list of lists of integers"),
                   read.required("weights", _list_of(_list_of(is_number)), "a list of lists of numbers"))


@dataclass(frozen=True)
class Usage:
    """A done event's `usage`. A counter a daemon did not send reads as 0 (cached_prompt_tokens
    came after the first daemons); counters this client does not know are kept in ``extra``."""

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of prompt_tokens, resumed from a kept prefix instead of prefilled
    generated_tokens: int = 0
    time_to_first_token_ms: float = 0.0
    decode_tokens_per_s: float = 0.0
    expert_cache_hits: int = 0
    expert_cache_misses: int = 0
    extra: Mapping[Any, Any] = field(default_factory=dict, repr=False)

    def to_wire(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "cached_prompt_tokens": self.cached_prompt_tokens,
                "generated_tokens": self.generated_tokens, "time_to_first_token_ms": self.time_to_first_token_ms,
                "decode_tokens_per_s": self.decode_tokens_per_s, "expert_cache_hits": self.expert_cache_hits,
                "expert_cache_misses": self.expert_cache_misses, **self.extra}

    @classmethod
    def from_wire(cls, message: Mapping[Any, Any]) -> "Usage":
        read = _Reader(message, "a done event's usage")
        counters = {name: read.optional(name, is_number, "a number", default)
                    for name, default in (("prompt_tokens", 0), ("cached_prompt_tokens", 0), ("generated_tokens", 0),
                                          ("time_to_first_token_ms", 0.0), ("decode_tokens_per_s", 0.0),
                                          ("expert_cache_hits", 0), ("expert_cache_misses", 0))}
        return cls(**counters, extra=read.extra())


@dataclass(frozen=True)
class RoutingLayer:
    """One MoE layer in a `routing` event: the experts the step's rows chose (increasing), how
    many rows chose each, and the expert cache's hits and misses in the step (None: no cache)."""

    layer: int
    experts: list[int]  # (K,) increasing
    counts: list[int]  # (K,) rows that chose experts[k]
    hits: int | None
    misses: int | None

    def to_wire(self) -> dict[str, Any]:
        return {"layer": self.layer, "experts": self.experts, "counts": self.counts, "hits": self.hits,
                "misses": self.misses}

    @classmethod
    def from_wire(cls, message: Any) -> "RoutingLayer":
        if not _is_map(message):
            raise ProtocolViolation(f"the daemon sent a routing event whose layers hold {message!r:.80}")
        read = _Reader(message, "a routing event's layer")
        layer = cls(read.required("layer", is_int, "an integer"),
                    read.required("experts", _list_of(is_int), "a list of integers"),
                    read.required("counts", _list_of(is_int), "a list of integers"),
                    read.optional("hits", is_int, "an integer"), read.optional("misses", is_int, "an integer"))
        if len(layer.experts) != len(layer.counts):
            raise ProtocolViolation(f"the daemon sent a routing event whose layer {layer.layer} has "
                                    f"{len(layer.experts)} experts and {len(layer.counts)} counts")
        return layer


# --------------------------------------------------------------------------------------------
# The events
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Event:
    """What every event has: the `id` of the request it belongs to (None: the whole connection),
    and the keys of its map this client does not know (``extra``, sent back out by to_wire())."""

    id: RequestId | None
    extra: Mapping[Any, Any] = field(default_factory=dict, kw_only=True, repr=False)

    name: ClassVar[str]
    final: ClassVar[bool] = True  # the last event of its request

    def to_wire(self) -> dict[Any, Any]:
        return {"event": self.name, "id": self.id, **self._fields(), **self.extra}

    def _fields(self) -> dict[str, Any]:
        return {}

    @classmethod
    def _read(cls, request_id: RequestId | None, read: _Reader) -> "_Event":
        return cls(request_id, extra=read.extra())


@dataclass(frozen=True)
class HelloEvent(_Event):
    """The reply to `hello`: the protocol the daemon speaks, its name, the model, its frame limit."""

    protocol: int
    server: str  # "colibrid 0.1.0"
    model: str
    max_frame_bytes: int  # the largest request frame the daemon accepts

    name: ClassVar[str] = "hello"

    def _fields(self) -> dict[str, Any]:
        return {"protocol": self.protocol, "server": self.server, "model": self.model,
                "max_frame_bytes": self.max_frame_bytes}

    @classmethod
    def _read(cls, request_id: RequestId | None, read: _Reader) -> "HelloEvent":
        return cls(request_id, read.required("protocol", is_int, "an integer"),
                   read.required("server", _is_str, "a string"), read.required("model", _is_str, "a string"),
                   read.required("max_frame_bytes", is_int, "an integer"), extra=read.extra())


@dataclass(frozen=True)
class TokenEvent(_Event):
    """One sampled token. With logprobs asked for, its logprob and the alternatives as
    [token_id, text, logprob], best first; with debug_routing, the experts that produced it."""

    token_ids: list[int]
    text: str  # may be empty while text that could begin a stop string is held back
    logprob: float | None = None
    top_logprobs: list[list[Any]] | None = None  # [[token_id, text, logprob], ...]; None: not asked for
    routing: TokenRouting | None = None

    name: ClassVar[str] = "token"
    final: ClassVar[bool] = False

    def _fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"token_ids": self.token_ids, "text": self.text}
        if self.top_logprobs is not None or self.logprob is not None:
            fields["logprob"] = self.logprob
        if self.top_logprobs is not None:
            fields["top_logprobs"] = self.top_logprobs
        if self.routing is not None:
            fields["routing"] = self.routing.to_wire()
        return fields

    @classmethod
    def _read(cls, request_id: RequestId | None, read: _Reader) -> "TokenEvent":
        token_ids = read.required("token_ids", _list_of(is_int), "a list of integers")
        text = read.required("text", _is_str, "a string")
        logprob = read.optional("logprob", is_number, "a number")
        top_logprobs = read.optional("top_logprobs", _list_of(_is_alternative), "a list of [id, text, logprob]")
        routing = read.optional("routing", _is_map, "a map")
        return cls(request_id, token_ids, text, logprob, top_logprobs,
                   None if routing is None else TokenRouting.from_wire(routing), extra=read.extra())


@dataclass(frozen=True)
class DoneEvent(_Event):
    """The end of an ask: why it ended, the whole text (the token events' texts joined), and its usage."""

    finish_reason: str  # "stop", "length", "eos", "context" or "cancelled"
    text: str
    usage: Usage

    name: ClassVar[str] = "done"

    def _fields(self) -> dict[str, Any]:
        return {"finish_reason": self.finish_reason, "text": self.text, "usage": self.usage.to_wire()}

    @classmethod
    def _read(cls, request_id: RequestId | None, read: _Reader) -> "DoneEvent":
        return cls(request_id, read.required("finish_reason", _is_str, "a string"),
                   read.required("text", _is_str, "a string"),
                   Usage.from_wire(read.required("usage", _is_map, "a map")), extra=read.extra())


@dataclass(frozen=True)
class ErrorEvent(_Event):
    """A refused or failed request (id None: the whole connection); ``damage`` (code
    `pack_damaged`): the damaged expert record the ask needed."""

    code: str
    message: str
    damage: Mapping[str, Any] | None = None

    name: ClassVar[str] = "error"

    def _fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.damage is not None:
            fields["damage"] = self.damage
        return fields

    @classmethod
    def _read(cls, request_id: RequestId | None, read: _Reader) -> "ErrorEvent":
        return cls(request_id, read.required("code", _is_str, "a string"), read.required("message", _is_str, "a string"),
                   read.optional("damage", _is_map, "a map"), extra=read.extra())


@dataclass(frozen=True)
class OkEvent(_Event):
    """The reply to a `cancel` (the target ends with its own last event), and to a verify in the
    background or a verify stop."""

    name: ClassVar[str] = "ok"


@dataclass(frozen=True)
class StatusEvent(_Event):
    """The daemon's view of itself: an open map (docs/protocol.md lists its fields), kept whole."""

    fields: Mapping[Any, Any]

    name: ClassVar[str] = "status"

    def _fields(self) -> dict[str, Any]:
        return dict(self.fields)

    @classmethod
    def _read(cls, request_id: RequestId | None, read: _Reader) -> "StatusEvent":
        return cls(request_id, read.extra())


@dataclass(frozen=True)
class ModelsEvent(_Event):
    """The models the daemon serves: each an open map (name, path, architecture, parameters_total, ...)."""

    models: list[Mapping[Any, Any]]

    name: ClassVar[str] = "models"

    def _fields(self) -> dict[str, Any]:
        return {"models": self.models}

    @classmethod
    def _read(cls, request_id: RequestId | None, read: _Reader) -> "ModelsEvent":
        return cls(request_id, read.required("models", _list_of(_is_map), "a list of maps"), extra=read.extra())


@dataclass(frozen=True)
class SubscribedEvent(_Event):
    """The first event of a subscription: the model's routing shape, for drawing what follows."""

    stream: str
    moe_layers: list[int]
    num_experts: int
    experts_per_token: int

    name: ClassVar[str] = "subscribed"
    final: ClassVar[bool] = False

    def _fields(self) -> dict[str, Any]:
        return {"stream": self.stream, "moe_layers": self.moe_layers, "num_experts": self.num_experts,
                "experts_per_token": self.experts_per_token}

    @classmethod
    def _read(cls, request_id: RequestId | None, read: _Reader) -> "SubscribedEvent":
        return cls(request_id, read.required("stream", _is_str, "a string"),
                   read.required("moe_layers", _list_of(is_int), "a list of integers"),
                   read.required("num_experts", is_int, "an integer"),
                   read.required("experts_per_token", is_int, "an integer"), extra=read.extra())


@dataclass(frozen=True)
class RoutingEvent(_Event):
    """One engine step's routing for a subscriber; ``dropped``: summaries it missed just before this one."""

    step: int
    step_ms: float
    rows: int  # the tokens the step ran
    sequences: int  # the asks in it
    layers: list[RoutingLayer]  # the MoE layers, in order
    dropped: int = 0

    name: ClassVar[str] = "routing"
    final: ClassVar[bool] = False

    def _fields(self) -> dict[str, Any]:
        return {"step": self.step, "step_ms": self.step_ms, "rows": self.rows, "sequences": self.sequences,
                "layers": [layer.to_wire() for layer in self.layers], "dropped": self.dropped}

    @classmethod
    def _read(cls, request_id: RequestId | None, read: _Reader) -> "RoutingEvent":
        step, step_ms = read.required("step", is_int, "an integer"), read.required("step_ms", is_number, "a number")
        rows, sequences = read.required("rows", is_int, "an integer"), read.required("sequences", is_int, "an integer")
        layers = [RoutingLayer.from_wire(layer) for layer in read.required("layers", _list_of(_is_map), "a list of maps")]
        return cls(request_id, step, step_ms, rows, sequences, layers,
                   read.required("dropped", is_int, "an integer"), extra=read.extra())


@dataclass(frozen=True)
class UnsubscribedEvent(_Event):
    """The last event of a subscription: ``reason`` "cancelled" or "shutdown"."""

    reason: str

    name: ClassVar[str] = "unsubscribed"

    def _fields(self) -> dict[str, Any]:
        return {"reason": self.reason}

    @classmethod
    def _read(cls, request_id: RequestId | None, read: _Reader) -> "UnsubscribedEvent":
        return cls(request_id, read.required("reason", _is_str, "a string"), extra=read.extra())


@dataclass(frozen=True)
class VerifyProgressEvent(_Event):
    """How far a foreground verify is."""

    bytes_done: int
    bytes_total: int
    elapsed_s: float
    mb_per_s: float
    eta_s: float | None  # None before the first byte
    file: str  # the file being read
    paused: bool  # waiting for the engine to be idle

    name: ClassVar[str] = "verify_progress"
    final: ClassVar[bool] = False

    def _fields(self) -> dict[str, Any]:
        return {"bytes_done": self.bytes_done, "bytes_total": self.bytes_total, "elapsed_s": self.elapsed_s,
                "mb_per_s": self.mb_per_s, "eta_s": self.eta_s, "file": self.file, "paused": self.paused}

    @classmethod
    def _read(cls, request_id: RequestId | None, read: _Reader) -> "VerifyProgressEvent":
        return cls(request_id, read.required("bytes_done", is_int, "an integer"),
                   read.required("bytes_total", is_int, "an integer"),
                   read.required("elapsed_s", is_number, "a number"), read.required("mb_per_s", is_number, "a number"),
                   read.optional("eta_s", is_number, "a number"), read.required("file", _is_str, "a string"),
                   read.required("paused", _is_bool, "a boolean"), extra=read.extra())


@dataclass(frozen=True)
class VerifyDamageEvent(_Event):
    """One finding of a verify: the file, a line for humans, and where, as far as it is known."""

    file: str
    message: str
    offset: int | None = None  # bytes into the file
    length: int | None = None
    layer: int | None = None  # an expert record's
    expert: int | None = None
    tensor: str | None = None  # a dense tensor's name

    name: ClassVar[str] = "verify_damage"
    final: ClassVar[bool] = False

    def _fields(self) -> dict[str, Any]:
        where = {"offset": self.offset, "length": self.length, "layer": self.layer, "expert": self.expert,
                 "tensor": self.tensor}
        return {"file": self.file, "message": self.message, **{k: v for k, v in where.items() if v is not None}}

    @classmethod
    def _read(cls, request_id: RequestId | None, read: _Reader) -> "VerifyDamageEvent":
        file, message = read.required("file", _is_str, "a string"), read.required("message", _is_str, "a string")
        where = {key: read.optional(key, is_int, "an integer") for key in ("offset", "length", "layer", "expert")}
        return cls(request_id, file, message, **where, tensor=read.optional("tensor", _is_str, "a string"),
                   extra=read.extra())


@dataclass(frozen=True)
class VerifiedEvent(_Event):
    """The end of a foreground verify: the whole report."""

    pack: str
    clean: bool
    cancelled: bool
    damage: list[Mapping[Any, Any]]  # the findings, at most 1000, as verify_damage gave them
    damage_found: int  # all of them
    notes: list[str]  # what could not be checked
    files: Mapping[Any, Any]  # file -> "ok", "damaged", "missing", "sha256 not recorded"
    bytes_read: int
    seconds: float

    name: ClassVar[str] = "verified"

    def _fields(self) -> dict[str, Any]:
        return {"pack": self.pack, "clean": self.clean, "cancelled": self.cancelled, "damage": self.damage,
                "damage_found": self.damage_found, "notes": self.notes, "files": self.files,
                "bytes_read": self.bytes_read, "seconds": self.seconds}

    @classmethod
    def _read(cls, request_id: RequestId | None, read: _Reader) -> "VerifiedEvent":
        return cls(request_id, read.required("pack", _is_str, "a string"), read.required("clean", _is_bool, "a boolean"),
                   read.required("cancelled", _is_bool, "a boolean"),
                   read.required("damage", _list_of(_is_map), "a list of maps"),
                   read.required("damage_found", is_int, "an integer"),
                   read.required("notes", _list_of(_is_str), "a list of strings"),
                   read.required("files", _is_map, "a map"), read.required("bytes_read", is_int, "an integer"),
                   read.required("seconds", is_number, "a number"), extra=read.extra())


@dataclass(frozen=True)
class UnknownEvent(_Event):
    """An event this client has no type for (a newer daemon's): kept, as a step of its request."""

    event: str
    fields: Mapping[Any, Any]

    final: ClassVar[bool] = False

    @property
    def name(self) -> str:  # type: ignore[override]  # what the daemon called it
        return self.event

    def to_wire(self) -> dict[Any, Any]:
        return {"event": self.event, "id": self.id, **self.fields}


Event = Union[HelloEvent, TokenEvent, DoneEvent, ErrorEvent, OkEvent, StatusEvent, ModelsEvent, SubscribedEvent,
              RoutingEvent, UnsubscribedEvent, VerifyProgressEvent, VerifyDamageEvent, VerifiedEvent, UnknownEvent]

EVENT_TYPES: dict[str, type[_Event]] = {cls.name: cls for cls in (
    HelloEvent, TokenEvent, DoneEvent, ErrorEvent, OkEvent, StatusEvent, ModelsEvent, SubscribedEvent, RoutingEvent,
    UnsubscribedEvent, VerifyProgressEvent, VerifyDamageEvent, VerifiedEvent)}


def event_from_wire(message: Mapping[Any, Any]) -> Event:
    """The typed event a decoded frame from the daemon holds; ProtocolViolation if it is malformed."""
    name = message.get("event")
    if not isinstance(name, str):
        raise ProtocolViolation(f"the daemon sent a map without an event name: {message!r:.200}")
    request_id = message.get("id")
    if not _is_request_id(request_id):
        raise ProtocolViolation(f"the daemon sent an event with id {request_id!r:.200}")
    event_type = EVENT_TYPES.get(name)
    if event_type is None:
        return UnknownEvent(request_id, name, {k: v for k, v in message.items() if k not in ("event", "id")})
    return event_type._read(request_id, _Reader(message, f"a{'n' if name[0] in 'aeiou' else ''} {name} event",
                                                ("event", "id")))
