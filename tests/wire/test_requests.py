"""colibrid.wire.requests on its own: the daemon's checks of a request, code by code as docs/protocol.md
lists them, and the requests a client builds."""

from __future__ import annotations

import subprocess
import sys

import pytest

from colibrid.wire.errors import ProtocolError
from colibrid.wire.requests import (
    Ask, AskFields, Cancel, Hello, Models, Status, Subscribe, Verify, parse_request, usable_id,
)


def parse(message, default_max_tokens=256, greeted=True):
    return parse_request(message, default_max_tokens, greeted=greeted)


def test_each_op_parses_to_its_request():
    assert parse({"op": "hello", "id": 0, "protocol": 1}) == Hello(0, 1, None)
    assert parse({"op": "cancel", "id": "c", "target": 3}) == Cancel("c", 3)
    assert parse({"op": "status", "id": "s"}) == Status("s")
    assert parse({"op": "models", "id": "m"}) == Models("m")
    ask = parse({"op": "ask", "id": 1, "prompt": "hi", "temperature": 0, "stop": ["\n"], "seed": 4, "top_k": 5})
    assert isinstance(ask, Ask) and (ask.prompt, ask.messages, ask.raw) == ("hi", None, False)
    assert (ask.params.temperature, ask.params.stop, ask.params.seed, ask.params.top_k) == (0, ("\n",), 4, 5)


def test_ask_defaults_come_from_the_server_and_nil_means_absent():
    ask = parse({"op": "ask", "id": 1, "prompt": "hi", "seed": None, "logprobs": None}, default_max_tokens=77)
    assert ask.params.max_tokens == 77 and ask.params.seed is None and ask.params.logprobs is None
    assert ask.params.temperature == 1.0


def test_ignore_eos_reaches_the_sampling_parameters_and_is_off_by_default():
    assert parse({"op": "ask", "id": 1, "prompt": "hi", "ignore_eos": True}).params.ignore_eos is True
    assert parse({"op": "ask", "id": 1, "prompt": "hi"}).params.ignore_eos is False
    assert parse({"op": "ask", "id": 1, "prompt": "hi", "ignore_eos": None}).params.ignore_eos is False


def test_the_model_s_sampling_defaults_fill_what_an_ask_omits():
    model_defaults = {"temperature": 0.7, "top_p": 0.95}
    ask = parse_request({"op": "ask", "id": 1, "prompt": "hi"}, 256, model_defaults)
    assert (ask.params.temperature, ask.params.top_p, ask.params.max_tokens) == (0.7, 0.95, 256)
    ask = parse_request({"op": "ask", "id": 2, "prompt": "hi", "temperature": 0, "top_p": None}, 256, model_defaults)
    assert (ask.params.temperature, ask.params.top_p) == (0, 0.95)


def test_unknown_fields_are_ignored():
    assert parse({"op": "status", "id": 1, "verbose": True}) == Status(1)


_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def _nested(depth: int) -> dict:
    """A map nested `depth` maps deep below its top level."""
    value: dict = {}
    for _ in range(depth):
        value = {"x": value}
    return value


def test_a_chat_with_tools_keeps_every_role_and_the_tool_calls():
    messages = [
        {"role": "system", "content": "You report the weather."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [_CALL]},  # OpenAI sends content null back
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"a": [1, 2.5, None]}}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp_c": 21}'},
        {"role": "assistant", "content": "21 C", "reasoning_content": "the tool said so"},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": _nested(13)}}]  # 16 maps deep
    ask = parse({"op": "ask", "id": 1, "messages": messages, "tools": tools})
    assert ask.messages == messages and ask.tools == tools
    assert parse({"op": "ask", "id": 1, "prompt": "x", "tools": []}).tools is None
    assert parse({"op": "ask", "id": 1, "prompt": "x"}).tools is None


def test_special_tokens_keeps_special_token_text_in_the_output():
    assert parse({"op": "ask", "id": 1, "prompt": "x"}).params.skip_special_tokens is True
    assert parse({"op": "ask", "id": 1, "prompt": "x", "special_tokens": True}).params.skip_special_tokens is False


@pytest.mark.parametrize("message, code", [
    ({"op": "hello", "id": 1}, "bad_request"),
    ({"op": "hello", "id": 1, "protocol": 2}, "unsupported_protocol"),
    ({"op": "hello", "id": 1, "protocol": "1"}, "bad_request"),
    ({"op": "hello", "id": True, "protocol": 1}, "bad_request"),
    ({"op": "fly", "id": 1}, "unknown_op"),
    ({"id": 1}, "bad_request"),
    ({"op": "ask", "id": 1, "prompt": "x", "top_k": 1.0}, "bad_request"),
    ({"op": "ask", "id": 1, "prompt": "x", "raw": 1}, "bad_request"),
    ({"op": "ask", "id": 1, "prompt": "x", "ignore_eos": 1}, "bad_request"),
    ({"op": "ask", "id": 1, "prompt": "x", "logprobs": 21}, "invalid_params"),
    ({"op": "ask", "id": 1, "prompt": "x", "top_p": 0}, "invalid_params"),
    ({"op": "ask", "id": 1, "prompt": "x", "max_tokens": 0}, "invalid_params"),
    ({"op": "ask", "id": 1, "prompt": "x", "stop": [""]}, "invalid_params"),
    ({"op": "ask", "id": 1, "prompt": "x", "temperature": float("nan")}, "invalid_params"),
    ({"op": "ask", "id": 1, "messages": [{"role": "user", "content": "x", "nick": "y"}]}, "bad_request"),
    ({"op": "ask", "id": 1, "messages": [{"role": "user"}]}, "bad_request"),
    ({"op": "ask", "id": 1, "messages": [{"role": "user", "content": 3}]}, "bad_request"),
    ({"op": "ask", "id": 1, "messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f",
                                                                                          "arguments": 3}}]}]},
     "bad_request"),
    ({"op": "ask", "id": 1, "messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]}, "bad_request"),
    ({"op": "ask", "id": 1, "messages": [{"role": "assistant", "tool_calls": [_CALL] * 65}]}, "bad_request"),
    ({"op": "ask", "id": 1, "prompt": "x", "tools": {"type": "function"}}, "bad_request"),
    ({"op": "ask", "id": 1, "prompt": "x", "tools": ["get_weather"]}, "bad_request"),
    ({"op": "ask", "id": 1, "prompt": "x", "tools": [{"type": "function"}] * 129}, "bad_request"),
    ({"op": "ask", "id": 1, "prompt": "x", "tools": [_nested(16)]}, "bad_request"),
    ({"op": "ask", "id": 1, "prompt": "x", "tools": [{"x": b"bytes"}]}, "bad_request"),
    ({"op": "ask", "id": 1, "prompt": "x", "special_tokens": 1}, "bad_request"),
    ({"op": "ask", "id": 1, "prompt": "x", "raw": True, "tools": [{"type": "function"}]}, "invalid_params"),
])
def test_refusals_carry_the_code_the_document_gives(message, code):
    with pytest.raises(ProtocolError) as caught:
        parse(message)
    assert caught.value.code == code
    assert caught.value.closes_connection == (code not in ("invalid_params",))


def test_until_hello_only_a_hello_is_a_request():
    assert parse({"op": "hello", "id": 0, "protocol": 1}, greeted=False) == Hello(0, 1, None)
    for message, request_id in (({"op": "status", "id": "s"}, "s"), ({"id": 7}, 7), ({"op": "ask", "id": 1.5}, None)):
        with pytest.raises(ProtocolError) as caught:
            parse_request(message, 256, greeted=False)
        assert (caught.value.code, caught.value.request_id) == ("bad_request", request_id)
        assert caught.value.message == "the first request on a connection must be hello"


def test_an_id_a_reply_may_carry():
    assert [usable_id({"id": value}) for value in ("x", 3, "x" * 257, True, 1.0, None)] == ["x", 3, None, None, None,
                                                                                            None]
    assert usable_id({}) is None


def test_a_string_id_may_be_256_bytes_long():
    assert parse({"op": "status", "id": "x" * 256}) == Status("x" * 256)
    assert parse({"op": "status", "id": "é" * 128}) == Status("é" * 128)  # 256 bytes in UTF-8


@pytest.mark.parametrize("request_id", ["x" * 257, "é" * 129, "7" * 900_000],
                         ids=["257-ascii", "258-bytes-utf8", "900-kB"])
def test_a_longer_id_is_a_bad_request_without_an_id(request_id):
    # Every event of a request repeats its id: a long one would be copied into each token event.
    with pytest.raises(ProtocolError) as caught:
        parse({"op": "ask", "id": request_id, "prompt": "hi"})
    assert caught.value.code == "bad_request" and caught.value.request_id is None
    assert "256 bytes" in caught.value.message


def test_a_cancel_target_longer_than_256_bytes_is_a_bad_request():
    with pytest.raises(ProtocolError) as caught:
        parse({"op": "cancel", "id": "c", "target": "t" * 257})
    assert caught.value.code == "bad_request" and caught.value.request_id == "c"


def test_the_protocol_imports_nothing_from_the_engine():
    """The wire format stands alone (a client, a gateway, a test can use it without numpy or
    libcolibri); what it shares with the engine, SamplingParams, is a plain value type."""
    script = ("import sys, colibrid.wire.requests, colibrid.wire.events, colibrid.wire.client; "
              "print(sorted(m for m in sys.modules if m.startswith('colibrid.engine')))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


# ---- the requests a client builds ----------------------------------------------------------


@pytest.mark.parametrize("request_value, message", [
    (Hello(1, 1, "colibrictl 0.1.0"), {"op": "hello", "id": 1, "protocol": 1, "client": "colibrictl 0.1.0"}),
    (Cancel(2, 1), {"op": "cancel", "id": 2, "target": 1}),
    (Subscribe("s", "routing"), {"op": "subscribe", "id": "s", "stream": "routing"}),
    (Status(3), {"op": "status", "id": 3}),
    (Models(4), {"op": "models", "id": 4}),
    (Verify(5), {"op": "verify", "id": 5}),
    (Verify(6, background=True, max_mb_per_s=20.0), {"op": "verify", "id": 6, "background": True, "max_mb_per_s": 20.0}),
    (Verify(7, stop=True), {"op": "verify", "id": 7, "stop": True}),
])
def test_a_request_a_client_builds_is_the_map_the_daemon_parses_back(request_value, message):
    assert request_value.to_wire() == message
    assert parse(message) == request_value


def test_an_ask_sends_only_the_fields_a_client_set():
    assert AskFields(prompt="hi").to_wire(1) == {"op": "ask", "id": 1, "prompt": "hi"}
    fields = AskFields(messages=[{"role": "user", "content": "hi"}], system="brief", raw=False, special_tokens=True,
                       temperature=0, top_k=0, seed=0, stop=["\n"], logprobs=0, ignore_eos=True, debug_routing=True)
    message = fields.to_wire("a")
    # Zeros are values; false flags are left out (the daemon's default), true ones sent.
    assert message == {"op": "ask", "id": "a", "messages": [{"role": "user", "content": "hi"}], "system": "brief",
                       "special_tokens": True, "temperature": 0, "top_k": 0, "seed": 0, "stop": ["\n"], "logprobs": 0,
                       "ignore_eos": True, "debug_routing": True}
    ask = parse(message)
    assert (ask.id, ask.messages, ask.system, ask.raw, ask.debug_routing) == \
        ("a", [{"role": "user", "content": "hi"}], "brief", False, True)
    assert (ask.params.temperature, ask.params.top_k, ask.params.seed, ask.params.stop, ask.params.logprobs,
            ask.params.ignore_eos, ask.params.skip_special_tokens) == (0, 0, 0, ("\n",), 0, True, False)
