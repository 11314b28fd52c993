"""Events (docs/protocol.md): what the daemon sends, one builder per event."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from colibrid import __version__
from colibrid.wire.errors import RequestId
from colibrid.wire.frames import PROTOCOL_VERSION

SERVER_NAME = f"colibrid {__version__}"

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
