"""The HTTP side: aiohttp routes for the OpenAI API, /health and /metrics, over colibrid.

Life of a generation request: the body is checked (openai_api), a connection to colibrid is
opened and greeted, the ask is sent, and its first event is awaited BEFORE any HTTP byte
goes out - so `busy`, `invalid_params`, a thermal pause or a daemon that is gone become a
proper status (429 with Retry-After, 400, 503), also for a streaming request. Then tokens
flow to the client, as SSE chunks or gathered into one JSON object, through the model's
output parser (model_output: content, reasoning, tool calls). If the client goes away
(aiohttp cancels the handler, or a write fails), the ask is cancelled and the connection
closed: colibrid stops generating within a token.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from pathlib import Path
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, AsyncIterator, Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from colibrid.gateway import openai_api
from colibrid.gateway.config import ConfigError, GatewayConfig
from colibrid.gateway.daemon_client import DaemonConnection, DaemonError, DaemonUnavailable, one_request
from colibrid.gateway.metrics import GatewayMetrics
from colibrid.gateway.model_output import Delta, PlainOutput, needs_special_tokens, new_parser, resolve_format
from colibrid.gateway.openai_api import GenerationRequest, OpenAIError
from colibrid.wire.errors import ProtocolViolation
from colibrid.wire.events import DoneEvent, TokenEvent

log = logging.getLogger(__name__)

# colibrid's error codes as HTTP statuses. Retryable ones carry Retry-After.
# pack_damaged: the request needs an expert record of the pack found damaged - the model cannot
# serve it now (others are served), which is not the client's fault: 503, as for a hot drive.
DAEMON_ERROR_STATUS = {"busy": 429, "invalid_params": 400, "thermal": 503, "device_missing": 503, "shutdown": 503,
                       "pack_damaged": 503}
RETRYABLE_STATUSES = frozenset({429, 503})
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               503: "service_unavailable"}


def load_api_keys(path: str) -> tuple[bytes, ...]:
    """The bearer keys in `path`, one a line (blank lines and # comments skipped); () for no file."""
    if not path:
        return ()
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"api_keys_file {path}: {exc.strerror}") from None
    keys = tuple(line.strip().encode() for line in lines if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise ConfigError(f"api_keys_file {path} holds no key: every request would be refused")
    return keys


def daemon_error(exc: DaemonError, retry_after_s: int) -> OpenAIError:
    status = DAEMON_ERROR_STATUS.get(exc.code, 500)
    return OpenAIError(status, exc.message, ERROR_TYPES.get(status, "server_error"), code=exc.code,
                       retry_after_s=retry_after_s if status in RETRYABLE_STATUSES else None)


def unavailable(exc: DaemonUnavailable, retry_after_s: int) -> OpenAIError:
    return OpenAIError(503, str(exc), "service_unavailable", code="daemon_unavailable", retry_after_s=retry_after_s)


def error_response(error: OpenAIError) -> web.Response:
    headers = {"Retry-After": str(int(error.retry_after_s))} if error.retry_after_s is not None else None
    return web.json_response(error.body(), status=error.status, headers=headers)


class _Answer:
    """What one request produced so far: for the log, the metrics and a non-streamed reply."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: list[dict[str, Any]] = []
        self.logprobs: list[Any] = []  # chat: logprobs.content entries; completions: the token events
        self.done: DoneEvent | None = None

    def add(self, deltas: list[Delta]) -> None:
        for delta in deltas:
            if delta.kind == "content":
                self.content.append(delta.text)
            elif delta.kind == "reasoning":
                self.reasoning.append(delta.text)
            else:
                self.tool_calls.append(delta.call.as_openai())


class Gateway:
    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or GatewayMetrics()
        self.api_keys = load_api_keys(config.api_keys_file)
        self._architectures: dict[str, str] = {}  # model name -> architecture, from `models`

    def application(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_request_bytes,
                              middlewares=[self._errors, self._authenticate])
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        return app

    # ---- middlewares ---------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Awaitable]) -> web.StreamResponse:
        """Every error the OpenAI way: {"error": {message, type, param, code}}."""
        try:
            return await handler(request)
        except OpenAIError as error:
            return error_response(error)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            message = {413: f"the request body is larger than max_request_bytes ({self.config.max_request_bytes})",
                       404: f"no route {request.method} {request.path}"}.get(exc.status, exc.reason)
            return error_response(OpenAIError(exc.status, message, ERROR_TYPES.get(exc.status, "server_error")))

    @web.middleware
    async def _authenticate(self, request: web.Request,
                            handler: Callable[[web.Request], Awaitable]) -> web.StreamResponse:
        """Bearer keys guard the API (/v1/...); /health and /metrics stay open for balancers and scrapers."""
        if self.api_keys and request.path.startswith("/v1/"):
            scheme, _, key = request.headers.get("Authorization", "").partition(" ")
            offered = key.strip().encode()
            # Compared with every key, in constant time each: the answer's timing says nothing.
            if scheme.lower() != "bearer" or not any([hmac.compare_digest(offered, k) for k in self.api_keys]):
                self.metrics.requests.labels(_endpoint(request.path), "unauthorized").inc()
                raise OpenAIError(401, "a valid API key is needed: Authorization: Bearer KEY",
                                  "authentication_error", code="invalid_api_key")
        return await handler(request)

    # ---- health, metrics, models -----------------------------------------------------------

    async def _status(self) -> Mapping[str, Any] | None:
        try:
            return (await one_request(self.config.socket, "status", self.config.daemon_timeout_s)).fields
        except Exception as exc:  # a scrape or a health check must never fail on the daemon's account
            log.debug("status from colibrid failed: %s", exc)
            return None

    async def health(self, request: web.Request) -> web.Response:
        """Ready only when colibrid answers: what a load balancer's health check reads."""
        status = await self._status()
        if status is None:
            return web.json_response({"status": "unavailable"}, status=503)
        return web.json_response({"status": "ok", "model": status.get("model"),
                                  "queue_depth": status.get("queue_depth"),
                                  "requests_running": status.get("requests_running")})

    async def prometheus(self, request: web.Request) -> web.Response:
        self.metrics.daemon_status.status = await self._status()
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _model_list(self) -> list[dict[str, Any]]:
        try:
            event = await one_request(self.config.socket, "models", self.config.daemon_timeout_s)
        except DaemonUnavailable as exc:
            raise unavailable(exc, self.config.retry_after_s) from None
        return [{"id": model.get("name"), "object": "model", "created": 0, "owned_by": "colibri",
                 "architecture": model.get("architecture")} for model in event.models]

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": await self._model_list()})

    async def model(self, request: web.Request) -> web.Response:
        for model in await self._model_list():
            if model["id"] == request.match_info["model"]:
                return web.json_response(model)
        raise OpenAIError(404, f"no model {request.match_info['model']!r} here", "not_found_error",
                          "model", "model_not_found")

    # ---- generation ------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat", openai_api.chat_request)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions", openai_api.completion_request)

    async def _json_body(self, request: web.Request) -> Any:
        try:
            return json.loads(await request.read())
        except (ValueError, UnicodeDecodeError):
            raise openai_api.invalid("the request body is not valid JSON") from None

    async def _architecture(self, connection: DaemonConnection) -> str:
        """The served model's architecture (which output format to parse), asked once per model."""
        name = connection.hello.model
        if name not in self._architectures:
            event = await connection.models()
            for model in event.models:
                self._architectures[str(model.get("name"))] = str(model.get("architecture"))
        return self._architectures.get(name, "")

    async def _generate(self, request: web.Request, endpoint: str,
                        parse: Callable[[Any], GenerationRequest]) -> web.StreamResponse:
        started_s = time.monotonic()
        outcome = "error"
        try:
            generation = parse(await self._json_body(request))
            connection = await DaemonConnection.open(self.config.socket, self.config.daemon_timeout_s)
            try:
                output_format = resolve_format(self.config.tool_call_format, await self._architecture(connection))
                if endpoint == "chat" and needs_special_tokens(output_format, generation.tools_given):
                    generation.ask = replace(generation.ask, special_tokens=True)
                parser = new_parser(output_format, generation.tools_given) if endpoint == "chat" else PlainOutput()
                timed = self._timed(connection.ask(generation.ask), started_s)
                first = await anext(timed)  # an error here is still an HTTP status
                reply = _Reply(endpoint, connection.hello.model, generation, parser)
                if generation.stream:
                    outcome = await self._stream(request, reply, first, timed)
                    return reply.response
                outcome = await self._gather(reply, first, timed)
                return web.json_response(reply.whole())
            finally:
                connection.cancel_open_ask()  # only if its done never came: the client left, or we failed
                connection.close()
        except OpenAIError as error:
            outcome = "invalid_request" if error.status in (400, 413) else outcome
            raise
        except DaemonError as exc:
            error = daemon_error(exc, self.config.retry_after_s)
            outcome = {429: "busy", 400: "invalid_request", 503: "unavailable"}.get(error.status, "error")
            raise error from None
        except DaemonUnavailable as exc:
            outcome = "unavailable"
            raise unavailable(exc, self.config.retry_after_s) from None
        except ProtocolViolation as exc:  # colibrid sent something the protocol does not allow
            log.error("colibrid broke the protocol: %s", exc)
            raise OpenAIError(502, f"colibrid sent a malformed reply: {exc}", "server_error",
                              code="bad_daemon_reply") from None
        except (asyncio.CancelledError, ConnectionResetError):
            outcome = "client_disconnected"
            raise
        finally:
            self.metrics.requests.labels(endpoint, outcome).inc()
            self.metrics.request_duration.observe(time.monotonic() - started_s)

    async def _timed(self, events: AsyncIterator[TokenEvent | DoneEvent],
                     started_s: float) -> AsyncIterator[TokenEvent | DoneEvent]:
        """The ask's events, with time to first token, inter-token latency and token counts measured."""
        last_token_s = None
        async for event in events:
            now = time.monotonic()
            if isinstance(event, TokenEvent):
                if last_token_s is None:
                    self.metrics.time_to_first_token.observe(now - started_s)
                else:
                    self.metrics.inter_token_latency.observe(now - last_token_s)
                last_token_s = now
            else:
                self.metrics.prompt_tokens.inc(max(0, int(event.usage.prompt_tokens)))
                self.metrics.generation_tokens.inc(max(0, int(event.usage.generated_tokens)))
            yield event

    async def _gather(self, reply: "_Reply", first: TokenEvent | DoneEvent,
                      events: AsyncIterator[TokenEvent | DoneEvent]) -> str:
        event = first
        while True:
            reply.take(event)
            if isinstance(event, DoneEvent):
                return reply.finish_reason()
            event = await anext(events)

    async def _stream(self, request: web.Request, reply: "_Reply", first: TokenEvent | DoneEvent,
                      events: AsyncIterator[TokenEvent | DoneEvent]) -> str:
        response = reply.response = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        await response.prepare(request)
        if reply.endpoint == "chat":
            await _send(response, reply.opening_chunk())
        event = first
        try:
            while True:
                for chunk in reply.take(event):
                    await _send(response, chunk)
                if isinstance(event, DoneEvent):
                    break
                event = await anext(events)
        except (DaemonError, DaemonUnavailable) as exc:  # the status line is gone: say it in the stream
            error = daemon_error(exc, 0) if isinstance(exc, DaemonError) else unavailable(exc, 0)
            await _send(response, error.body())
            await response.write_eof()
            return "busy" if error.status == 429 else "unavailable" if error.status == 503 else "error"
        for chunk in reply.closing_chunks():
            await _send(response, chunk)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return reply.finish_reason()


async def _send(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n")


def _endpoint(path: str) -> str:
    """The `endpoint` label of a /v1 path: chat, completions or models."""
    return "chat" if path.startswith("/v1/chat") else "completions" if path.startswith("/v1/completions") else "models"


class _Reply:
    """One answer in the API's shapes: chat.completion(.chunk) or text_completion."""

    def __init__(self, endpoint: str, model: str, generation: GenerationRequest, parser) -> None:
        self.endpoint = endpoint
        self.model = model
        self.generation = generation
        self.parser = parser
        self.answer = _Answer()
        self.id = openai_api.new_id("chatcmpl" if endpoint == "chat" else "cmpl")
        self.created = openai_api.now_s()
        self.response: web.StreamResponse | None = None
        self._text_offset = 0

    # ---- events in ---------------------------------------------------------------------------

    def take(self, event: TokenEvent | DoneEvent) -> list[dict[str, Any]]:
        """Account for one daemon event; the stream chunks it gives."""
        if isinstance(event, TokenEvent):
            deltas = self.parser.feed(event.text)
            self.answer.add(deltas)
            logprobs = None
            if self.generation.logprobs:
                logprobs = self._token_logprobs(event)
            return self._chunks(deltas, logprobs)
        self.answer.done = event
        deltas = self.parser.finish()
        self.answer.add(deltas)
        return self._chunks(deltas, None)

    def _token_logprobs(self, event: TokenEvent) -> dict[str, Any]:
        if self.endpoint == "chat":
            entry = openai_api.chat_logprob(event)
            self.answer.logprobs.append(entry)
            return {"content": [entry]}
        self.answer.logprobs.append(event)
        chunk = openai_api.completion_logprobs([event], self._text_offset)
        self._text_offset += len(event.text)
        return chunk

    def finish_reason(self) -> str:
        done = self.answer.done
        return openai_api.finish_reason(done.finish_reason if done is not None else "", bool(self.answer.tool_calls))

    # ---- non-streamed ------------------------------------------------------------------------

    def whole(self) -> dict[str, Any]:
        usage = openai_api.usage(self.answer.done)
        if self.endpoint == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": "".join(self.answer.content)}
            if self.answer.tool_calls:
                message["tool_calls"] = self.answer.tool_calls
                message["content"] = message["content"] or None
            if self.answer.reasoning:
                message["reasoning_content"] = "".join(self.answer.reasoning)
            logprobs = {"content": self.answer.logprobs} if self.generation.logprobs else None
            choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": self.finish_reason()}
            return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                    "choices": [choice], "usage": usage}
        logprobs = openai_api.completion_logprobs(self.answer.logprobs) if self.generation.logprobs else None
        choice = {"index": 0, "text": "".join(self.answer.content), "logprobs": logprobs,
                  "finish_reason": self.finish_reason()}
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage}

    # ---- streamed ------------------------------------------------------------------------------

    def _chunk(self, choice_fields: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        if self.endpoint == "chat":
            choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason, **choice_fields}
            chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                     "choices": [choice]}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason, **choice_fields}
            chunk = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                     "choices": [choice]}
        if self.generation.include_usage:
            chunk["usage"] = None
        return chunk

    def opening_chunk(self) -> dict[str, Any]:
        """A chat stream's first chunk names the role, as OpenAI's does."""
        return self._chunk({"delta": {"role": "assistant", "content": ""}})

    def _chunks(self, deltas: list[Delta], logprobs: dict[str, Any] | None) -> list[dict[str, Any]]:
        chunks = []
        for delta in deltas:
            if self.endpoint != "chat":
                chunks.append(self._chunk({"text": delta.text}))
            elif delta.kind == "tool_call":
                index = self.answer.tool_calls.index(delta.call.as_openai())
                chunks.append(self._chunk({"delta": {"tool_calls": [{"index": index, **delta.call.as_openai()}]}}))
            else:
                key = "content" if delta.kind == "content" else "reasoning_content"
                chunks.append(self._chunk({"delta": {key: delta.text}}))
        if logprobs is not None:
            if chunks:
                chunks[-1]["choices"][0]["logprobs"] = logprobs
            else:  # the token's text is held back (a possible marker): its logprob goes out now
                chunks.append(self._chunk({"logprobs": logprobs}))
        return chunks

    def closing_chunks(self) -> list[dict[str, Any]]:
        chunks = [self._chunk({}, self.finish_reason())]
        if self.generation.include_usage:
            chunks.append({"id": self.id, "object": chunks[0]["object"], "created": self.created,
                           "model": self.model, "choices": [], "usage": openai_api.usage(self.answer.done)})
        return chunks
