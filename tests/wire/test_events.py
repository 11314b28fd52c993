"""colibrid.wire.events: every event of docs/protocol.md as the daemon sends it (keys, values and
their order), read back by a client into the same value, and malformed ones refused."""

from __future__ import annotations

import json
import re

import msgpack
import pytest

from colibrid.wire.errors import ProtocolViolation
from colibrid.wire.events import (
    DoneEvent, ErrorEvent, HelloEvent, ModelsEvent, OkEvent, RoutingEvent, RoutingLayer, StatusEvent, SubscribedEvent,
    TokenEvent, TokenRouting, UnknownEvent, UnsubscribedEvent, Usage, VerifiedEvent, VerifyDamageEvent,
    VerifyProgressEvent, event_from_wire,
)
from colibrid.wire.frames import decode_event_body, encode_frame

USAGE = Usage(prompt_tokens=5, cached_prompt_tokens=2, generated_tokens=3, time_to_first_token_ms=12.5,
              decode_tokens_per_s=41.0, expert_cache_hits=90, expert_cache_misses=10)
DAMAGE = {"layer": 1, "expert": 3, "offset": 4096, "length": 512, "found_by": "load", "crc32c": 7}

# Each event, and the map docs/protocol.md gives for it, keys in the order the daemon sends them.
EVENTS = [
    (HelloEvent(0, 1, "colibrid 0.1.0", "demo", 1 << 20),
     {"event": "hello", "id": 0, "protocol": 1, "server": "colibrid 0.1.0", "model": "demo", "max_frame_bytes": 1 << 20}),
    (TokenEvent(1, [42], "Hi"), {"event": "token", "id": 1, "token_ids": [42], "text": "Hi"}),
    (TokenEvent(1, [42], "Hi", -0.5, [[42, "Hi", -0.5], [7, "Hello", -1.25]]),
     {"event": "token", "id": 1, "token_ids": [42], "text": "Hi", "logprob": -0.5,
      "top_logprobs": [[42, "Hi", -0.5], [7, "Hello", -1.25]]}),
    (TokenEvent(1, [2], "", -0.1, []),  # logprobs 0: the chosen token's logprob, no alternatives
     {"event": "token", "id": 1, "token_ids": [2], "text": "", "logprob": -0.1, "top_logprobs": []}),
    (TokenEvent("a", [42], "Hi", routing=TokenRouting(9, [0, 1], [[3, 1], [0, 2]], [[0.75, 0.25], [0.5, 0.5]])),
     {"event": "token", "id": "a", "token_ids": [42], "text": "Hi",
      "routing": {"step": 9, "layers": [0, 1], "experts": [[3, 1], [0, 2]], "weights": [[0.75, 0.25], [0.5, 0.5]]}}),
    (DoneEvent(1, "length", "Hi there", USAGE),
     {"event": "done", "id": 1, "finish_reason": "length", "text": "Hi there",
      "usage": {"prompt_tokens": 5, "cached_prompt_tokens": 2, "generated_tokens": 3, "time_to_first_token_ms": 12.5,
                "decode_tokens_per_s": 41.0, "expert_cache_hits": 90, "expert_cache_misses": 10}}),
    (DoneEvent(1, "cancelled", "", Usage()),  # cancelled while it waited: zeros, the times as floats
     {"event": "done", "id": 1, "finish_reason": "cancelled", "text": "",
      "usage": {"prompt_tokens": 0, "cached_prompt_tokens": 0, "generated_tokens": 0, "time_to_first_token_ms": 0.0,
                "decode_tokens_per_s": 0.0, "expert_cache_hits": 0, "expert_cache_misses": 0}}),
    (ErrorEvent(None, "bad_frame", "frame body is not one msgpack object (ExtraData)"),
     {"event": "error", "id": None, "code": "bad_frame", "message": "frame body is not one msgpack object (ExtraData)"}),
    (ErrorEvent(4, "pack_damaged", "pack damaged", DAMAGE),
     {"event": "error", "id": 4, "code": "pack_damaged", "message": "pack damaged", "damage": DAMAGE}),
    (OkEvent("c"), {"event": "ok", "id": "c"}),
    (StatusEvent("s", {"model": "demo", "cache": {"hits": 3}, "queue_depth": 0}),
     {"event": "status", "id": "s", "model": "demo", "cache": {"hits": 3}, "queue_depth": 0}),
    (ModelsEvent("m", [{"name": "demo", "architecture": "olmoe"}]),
     {"event": "models", "id": "m", "models": [{"name": "demo", "architecture": "olmoe"}]}),
    (SubscribedEvent("r", "routing", [0, 1], 16, 4),
     {"event": "subscribed", "id": "r", "stream": "routing", "moe_layers": [0, 1], "num_experts": 16,
      "experts_per_token": 4}),
    (RoutingEvent("r", 7, 3.5, 2, 1, [RoutingLayer(0, [1, 5], [2, 2], 3, 1), RoutingLayer(1, [0], [4], None, None)], 2),
     {"event": "routing", "id": "r", "step": 7, "step_ms": 3.5, "rows": 2, "sequences": 1,
      "layers": [{"layer": 0, "experts": [1, 5], "counts": [2, 2], "hits": 3, "misses": 1},
                 {"layer": 1, "experts": [0], "counts": [4], "hits": None, "misses": None}], "dropped": 2}),
    (UnsubscribedEvent("r", "shutdown"), {"event": "unsubscribed", "id": "r", "reason": "shutdown"}),
    (VerifyProgressEvent("v", 100, 1000, 0.5, 0.2, 4.5, "experts.bin", False),
     {"event": "verify_progress", "id": "v", "bytes_done": 100, "bytes_total": 1000, "elapsed_s": 0.5,
      "mb_per_s": 0.2, "eta_s": 4.5, "file": "experts.bin", "paused": False}),
    (VerifyProgressEvent("v", 0, 1000, 0.0, 0.0, None, "dense.bin", True),
     {"event": "verify_progress", "id": "v", "bytes_done": 0, "bytes_total": 1000, "elapsed_s": 0.0,
      "mb_per_s": 0.0, "eta_s": None, "file": "dense.bin", "paused": True}),
    (VerifyDamageEvent("v", "experts.bin", "expert 3 of layer 1 is damaged", offset=4096, length=512, layer=1, expert=3),
     {"event": "verify_damage", "id": "v", "file": "experts.bin", "message": "expert 3 of layer 1 is damaged",
      "offset": 4096, "length": 512, "layer": 1, "expert": 3}),
    (VerifyDamageEvent("v", "dense.bin", "tensor x is damaged", tensor="x"),
     {"event": "verify_damage", "id": "v", "file": "dense.bin", "message": "tensor x is damaged", "tensor": "x"}),
    (VerifiedEvent("v", "/packs/demo.pack", False, False, [{"file": "experts.bin", "message": "m"}], 1, ["a note"],
                   {"experts.bin": "damaged"}, 1000, 1.5),
     {"event": "verified", "id": "v", "pack": "/packs/demo.pack", "clean": False, "cancelled": False,
      "damage": [{"file": "experts.bin", "message": "m"}], "damage_found": 1, "notes": ["a note"],
      "files": {"experts.bin": "damaged"}, "bytes_read": 1000, "seconds": 1.5}),
]


@pytest.mark.parametrize("event, message", EVENTS, ids=[f"{m['event']}-{i}" for i, (_, m) in enumerate(EVENTS)])
def test_each_event_is_the_map_the_document_gives_and_reads_back(event, message):
    assert event.to_wire() == message
    assert list(event.to_wire()) == list(message)  # in the order the daemon has always sent
    received = decode_event_body(encode_frame(event.to_wire())[4:])
    assert event_from_wire(received) == event
    assert event_from_wire(received).to_wire() == message


def test_every_event_of_the_document_has_a_type():
    assert {message["event"] for _, message in EVENTS} == {
        "hello", "token", "done", "error", "ok", "status", "models", "subscribed", "routing", "unsubscribed",
        "verify_progress", "verify_damage", "verified"}


def test_the_last_event_of_a_request_says_so():
    finals = {message["event"] for event, message in EVENTS if event.final}
    assert finals == {"hello", "done", "error", "ok", "status", "models", "unsubscribed", "verified"}


def test_what_a_newer_daemon_adds_is_kept_and_sent_back_out():
    message = {"event": "done", "id": 1, "finish_reason": "stop", "text": "x", "spent_joules": 3.5,
               "usage": {"prompt_tokens": 1, "generated_tokens": 1, "speculated_tokens": 4}}
    done = event_from_wire(message)
    assert isinstance(done, DoneEvent) and done.usage.prompt_tokens == 1
    assert done.extra == {"spent_joules": 3.5} and done.usage.extra == {"speculated_tokens": 4}
    wire = done.to_wire()
    assert wire["spent_joules"] == 3.5 and wire["usage"]["speculated_tokens"] == 4
    assert done.usage.cached_prompt_tokens == 0  # a counter an older daemon does not send reads as 0
    news = event_from_wire({"event": "thermal_alert", "id": None, "state": "critical"})
    assert news == UnknownEvent(None, "thermal_alert", {"state": "critical"}) and not news.final
    assert news.to_wire() == {"event": "thermal_alert", "id": None, "state": "critical"}


def test_a_client_event_prints_as_the_json_it_came_as():
    # colibrictl --json prints to_wire(): for what a daemon sends, the same object, field for field.
    for _, message in EVENTS:
        assert json.dumps(event_from_wire(msgpack.unpackb(msgpack.packb(message))).to_wire()) == json.dumps(message)


@pytest.mark.parametrize("message, says", [
    ({"id": 1, "text": "x"}, "without an event name"),
    ({"event": 3, "id": 1}, "without an event name"),
    ({"event": "ok", "id": [1]}, "with id"),
    ({"event": "ok", "id": 1.5}, "with id"),
    ({"event": "ok", "id": True}, "with id"),
    ({"event": "token", "id": 1, "token_ids": [1]}, "a token event without `text`"),
    ({"event": "token", "id": 1, "token_ids": [1], "text": 7}, "whose `text` is not a string"),
    ({"event": "token", "id": 1, "token_ids": ["1"], "text": "x"}, "`token_ids` is not a list of integers"),
    ({"event": "token", "id": 1, "token_ids": [1], "text": "x", "logprob": "low"}, "`logprob` is not a number"),
    ({"event": "token", "id": 1, "token_ids": [1], "text": "x", "top_logprobs": [[1, "x"]]}, "`top_logprobs`"),
    ({"event": "token", "id": 1, "token_ids": [1], "text": "x", "routing": {"step": 1}}, "routing without `layers`"),
    ({"event": "done", "id": 1, "text": "x", "usage": {}}, "a done event without `finish_reason`"),
    ({"event": "done", "id": 1, "finish_reason": "stop", "text": "x"}, "without `usage`"),
    ({"event": "done", "id": 1, "finish_reason": "stop", "text": "x", "usage": [1]}, "`usage` is not a map"),
    ({"event": "done", "id": 1, "finish_reason": "stop", "text": "x", "usage": {"prompt_tokens": "5"}},
     "usage whose `prompt_tokens` is not a number"),
    ({"event": "error", "id": 1, "message": "m"}, "an error event without `code`"),
    ({"event": "error", "id": 1, "code": "busy", "message": None}, "`message` is not a string"),
    ({"event": "hello", "id": 0, "protocol": "1", "server": "s", "model": "m", "max_frame_bytes": 1},
     "`protocol` is not an integer"),
    ({"event": "models", "id": 1, "models": {"name": "m"}}, "`models` is not a list of maps"),
    ({"event": "subscribed", "id": 1, "stream": "routing", "moe_layers": [0], "num_experts": 16}, "experts_per_token"),
    ({"event": "routing", "id": 1, "step": 1, "step_ms": 1.0, "rows": 1, "sequences": 1, "dropped": 0,
      "layers": [{"layer": 0, "experts": [1, 2], "counts": [1], "hits": None, "misses": None}]}, "2 experts and 1 counts"),
    ({"event": "routing", "id": 1, "step": 1, "step_ms": 1.0, "rows": 1, "sequences": 1, "dropped": 0,
      "layers": [{"layer": 0, "experts": [1], "counts": [1], "hits": "3"}]}, "`hits` is not an integer"),
    ({"event": "unsubscribed", "id": 1}, "an unsubscribed event without `reason`"),
    ({"event": "verify_progress", "id": 1, "bytes_done": 1, "bytes_total": 2, "elapsed_s": 1, "mb_per_s": 1,
      "file": "f", "paused": "no"}, "`paused` is not a boolean"),
    ({"event": "verify_damage", "id": 1, "file": "f", "message": "m", "layer": "1"}, "`layer` is not an integer"),
    ({"event": "verified", "id": 1, "pack": "p", "clean": True}, "without `cancelled`"),
])
def test_a_malformed_event_is_a_protocol_violation(message, says):
    with pytest.raises(ProtocolViolation, match=re.escape(says)):
        event_from_wire(message)
