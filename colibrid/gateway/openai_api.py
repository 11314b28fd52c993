"""The OpenAI API's request bodies checked and turned into colibrid asks (AskFields), and its
response objects built. Pure: no HTTP, no sockets, so tests hold it against the API as
documented.

What is honoured: messages (system, developer, user, assistant with tool_calls, tool), prompt,
max_tokens / max_completion_tokens, temperature, top_p, stop, seed, logprobs / top_logprobs,
stream and stream_options.include_usage, tools and tool_choice. `n` above 1 and a `prompt`
list of several prompts are refused (400), as a server that cannot do them should. Other
fields the API defines (presence_penalty, user, metadata, response_format, ...) and unknown
fields are ignored, as OpenAI ignores fields it does not know.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from colibrid.wire.events import DoneEvent, TokenEvent
from colibrid.wire.requests import AskFields
from colibrid.wire.values import is_number

# OpenAI caps top_logprobs at 20 and stop at 4 sequences; colibrid takes the same 20.
MAX_TOP_LOGPROBS = 20
MAX_STOP_SEQUENCES = 4
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class OpenAIError(Exception):
    """An error answered as the OpenAI API answers errors: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, error_type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


@dataclass
class GenerationRequest:
    """One OpenAI request, checked: the ask to send and how to answer."""

    ask: AskFields  # what is asked of colibrid
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    tools_given: bool = False
    echo_model: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# Field checks
# --------------------------------------------------------------------------------------------


def _optional(body: dict[str, Any], name: str, check, expected: str) -> Any:
    value = body.get(name)
    if value is not None and not check(value):
        raise invalid(f"'{name}' must be {expected}, got {json.dumps(value)[:80]}", name)
    return value


def _sampling_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The generation options the body gives, as AskFields keywords."""
    ask: dict[str, Any] = {}
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        if not (isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens >= 1):
            raise invalid("'max_tokens' must be an integer of at least 1", "max_tokens")
        ask["max_tokens"] = max_tokens
    temperature = _optional(body, "temperature", lambda v: is_number(v) and 0 <= v <= 2, "a number from 0 to 2")
    if temperature is not None:
        ask["temperature"] = float(temperature)
    top_p = _optional(body, "top_p", lambda v: is_number(v) and 0 < v <= 1, "a number in (0, 1]")
    if top_p is not None:
        ask["top_p"] = float(top_p)
    seed = _optional(body, "seed", lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer")
    if seed is not None:
        ask["seed"] = seed & 0xFFFF_FFFF_FFFF_FFFF  # OpenAI takes negative seeds; colibrid wants >= 0
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None:
        if not (isinstance(stop, list) and len(stop) <= MAX_STOP_SEQUENCES and all(isinstance(s, str) for s in stop)):
            raise invalid(f"'stop' must be a string or a list of at most {MAX_STOP_SEQUENCES} strings", "stop")
        if any(s for s in stop):
            ask["stop"] = [s for s in stop if s]
    n = _optional(body, "n", lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer")
    if n is not None and n != 1:
        raise invalid("'n' other than 1 is not supported: this server generates one choice per request", "n",
                      "unsupported_value")
    return ask


def _stream_fields(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = bool(_optional(body, "stream", lambda v: isinstance(v, bool), "a boolean"))
    options = _optional(body, "stream_options", lambda v: isinstance(v, dict), "an object") or {}
    if options and not stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
    return stream, bool(options.get("include_usage"))


# --------------------------------------------------------------------------------------------
# Chat
# --------------------------------------------------------------------------------------------


def _text_content(content: Any, where: str) -> str | None:
    """A message's content: a string, null, or a list of text parts (joined)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise invalid(f"{where}: only text content parts are supported, got {kind!r}", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"{where}: 'content' must be a string, null or a list of text parts", "messages")


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
        raise invalid(f"{where}: each tool call needs 'function' with a 'name'", "messages")
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, (str, dict)):
        raise invalid(f"{where}: a tool call's 'arguments' must be a JSON string", "messages")
    if isinstance(arguments, str):
        # Chat templates (transformers' convention) expect a map; OpenAI sends a JSON string.
        try:
            parsed = json.loads(arguments or "{}")
        except ValueError:
            parsed = None
        arguments = parsed if isinstance(parsed, dict) else arguments
    converted = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        converted["id"] = call["id"]
    return converted


def _chat_message(message: Any, index: int) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise invalid(f"{where} must be an object", "messages")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise invalid(f"{where}: 'role' must be one of {', '.join(CHAT_ROLES)}, got {json.dumps(role)[:40]}",
                      "messages")
    converted: dict[str, Any] = {"role": "system" if role == "developer" else role}
    content = _text_content(message.get("content"), where)
    tool_calls = message.get("tool_calls") if role == "assistant" else None
    if tool_calls is not None:
        if not isinstance(tool_calls, list):
            raise invalid(f"{where}: 'tool_calls' must be a list", "messages")
        converted["tool_calls"] = [_tool_call(call, where) for call in tool_calls]
    if content is None and not converted.get("tool_calls"):
        if role != "assistant":
            raise invalid(f"{where}: 'content' is required for role {role}", "messages")
        content = ""
    if content is not None:
        converted["content"] = content
    for key in ("tool_call_id", "name", "reasoning_content"):
        if isinstance(message.get(key), str):
            converted[key] = message[key]
    return converted


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The tools the template sees: none for tool_choice "none", the named one for a forced choice."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not (isinstance(tools, list) and all(isinstance(tool, dict) and isinstance(tool.get("function"), dict)
                                            and isinstance(tool["function"].get("name"), str) for tool in tools)):
        raise invalid("'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\", ...}}", "tools")
    choice = body.get("tool_choice", "auto")
    if choice in ("auto", "required") or choice is None:
        return tools or None
    if choice == "none":
        return None
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        chosen = [tool for tool in tools if tool["function"]["name"] == name]
        if not chosen:
            raise invalid(f"tool_choice names {json.dumps(name)[:80]}, which is not in 'tools'", "tool_choice")
        return chosen
    raise invalid("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                  "\"function\": {\"name\": ...}}", "tool_choice")


def chat_request(body: Any) -> GenerationRequest:
    """A POST /v1/chat/completions body, checked; OpenAIError (400) for what cannot be served."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list", "messages")
    ask: dict[str, Any] = {"messages": [_chat_message(message, index) for index, message in enumerate(messages)]}
    ask |= _sampling_fields(body)  # AskFields keywords, gathered as the body is checked
    logprobs = bool(_optional(body, "logprobs", lambda v: isinstance(v, bool), "a boolean"))
    top_logprobs = _optional(body, "top_logprobs", lambda v: isinstance(v, int) and not isinstance(v, bool)
                             and 0 <= v <= MAX_TOP_LOGPROBS, f"an integer from 0 to {MAX_TOP_LOGPROBS}")
    if top_logprobs is not None and not logprobs:
        raise invalid("'top_logprobs' needs 'logprobs' true", "top_logprobs")
    if logprobs:
        ask["logprobs"] = top_logprobs or 0
    tools = _tools(body)
    if tools:
        ask["tools"] = tools
    stream, include_usage = _stream_fields(body)
    return GenerationRequest(AskFields(**ask), stream, include_usage, logprobs, bool(tools), _model(body))


# --------------------------------------------------------------------------------------------
# Completions (a raw prompt)
# --------------------------------------------------------------------------------------------


def completion_request(body: Any) -> GenerationRequest:
    """A POST /v1/completions body: the prompt is the model's whole text (no chat template)."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise invalid("'prompt' must be a string (one prompt per request)", "prompt")
    if body.get("echo") or body.get("suffix") or (body.get("best_of") not in (None, 1)):
        raise invalid("'echo', 'suffix' and 'best_of' are not supported", "echo", "unsupported_value")
    ask: dict[str, Any] = {"prompt": prompt, "raw": True, **_sampling_fields(body)}
    if "max_tokens" not in ask:
        ask["max_tokens"] = 16  # the completions API's documented default
    logprobs = _optional(body, "logprobs", lambda v: isinstance(v, int) and not isinstance(v, bool)
                         and 0 <= v <= 5, "an integer from 0 to 5")
    if logprobs is not None:
        ask["logprobs"] = logprobs
    stream, include_usage = _stream_fields(body)
    return GenerationRequest(AskFields(**ask), stream, include_usage, logprobs is not None, False, _model(body))


def _model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("'model' must be a string", "model")
    return model


# --------------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def now_s() -> int:
    return int(time.time())


# colibrid's finish reasons as the API names them. `context`: the context filled up, which
# OpenAI reports as length too.
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}


def finish_reason(daemon_reason: str, tool_calls: bool) -> str:
    return "tool_calls" if tool_calls else FINISH_REASONS.get(daemon_reason, "stop")


def usage(done: DoneEvent) -> dict[str, Any]:
    """OpenAI's usage from a `done` event's: the prompt tokens colibrid resumed from a kept
    prefix instead of prefilling are OpenAI's cached tokens."""
    counts = done.usage
    prompt_tokens, completion_tokens = int(counts.prompt_tokens), int(counts.generated_tokens)
    cached_tokens = int(counts.cached_prompt_tokens)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", "surrogatepass"))


def _logprob(event: TokenEvent) -> float:
    return 0.0 if event.logprob is None else event.logprob


def chat_logprob(event: TokenEvent) -> dict[str, Any]:
    """One entry of a chat choice's logprobs.content, from a `token` event."""
    text = event.text
    return {"token": text, "logprob": _logprob(event), "bytes": _token_bytes(text),
            "top_logprobs": [{"token": alt_text, "logprob": logprob, "bytes": _token_bytes(alt_text)}
                             for _, alt_text, logprob in event.top_logprobs or ()]}


def completion_logprobs(events: list[TokenEvent], offset: int = 0) -> dict[str, Any]:
    """A completions choice's logprobs (the legacy shape: parallel lists)."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for event in events:
        offsets.append(offset)
        text = event.text
        offset += len(text)
        tokens.append(text)
        logprobs.append(_logprob(event))
        tops.append({alt_text: logprob for _, alt_text, logprob in event.top_logprobs or ()})
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}
