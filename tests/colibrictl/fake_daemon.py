"""A scripted stand-in for colibrid: speaks docs/protocol.md on a Unix socket from a thread.

It has its own framing code on purpose (not colibrictl's): a bug in the client's framing must
not be mirrored by the server it is tested against. It records every request it receives, so
tests can check what reached the "daemon" (the prompt, the options, a cancel).

How an ``ask`` is answered is a *script*: a function ``script(reply, request)`` run on its own
thread, so the connection keeps reading (and sees a ``cancel``) while tokens stream.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from typing import Callable

import msgpack

_LENGTH = struct.Struct(">I")

USAGE = {  # every counter docs/protocol.md gives a done event
    "prompt_tokens": 5,
    "cached_prompt_tokens": 0,
    "generated_tokens": 3,
    "time_to_first_token_ms": 12.5,
    "decode_tokens_per_s": 41.0,
    "expert_cache_hits": 90,
    "expert_cache_misses": 10,
}


def send_frame(sock: socket.socket, message: dict) -> None:
    body = msgpack.packb(message, use_bin_type=True)
    sock.sendall(_LENGTH.pack(len(body)) + body)


def recv_exactly(sock: socket.socket, count: int) -> bytes | None:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def recv_frame(sock: socket.socket) -> dict | None:
    """The next request, or None when the client has closed the connection."""
    header = recv_exactly(sock, _LENGTH.size)
    if header is None:
        return None
    body = recv_exactly(sock, _LENGTH.unpack(header)[0])
    return None if body is None else msgpack.unpackb(body, raw=False)


class Reply:
    """What an ask script uses to answer one request."""

    def __init__(self, send: Callable[[dict], None], request_id, cancelled: threading.Event):
        self._send = send
        self.id = request_id
        self.cancelled = cancelled  # set when the client sends cancel for this request

    def token(self, text: str, token_ids: list[int] | None = None, **extra) -> None:
        self._send({"event": "token", "id": self.id, "token_ids": token_ids or [1],
                    "text": text, **extra})

    def done(self, text: str, finish_reason: str = "stop") -> None:
        self._send({"event": "done", "id": self.id, "finish_reason": finish_reason,
                    "text": text, "usage": dict(USAGE)})

    def error(self, code: str, message: str) -> None:
        self._send({"event": "error", "id": self.id, "code": code, "message": message})


# ---- ask scripts ------------------------------------------------------------------------------


def answer(*texts: str, delay_s: float = 0.0, gates: dict[int, threading.Event] | None = None):
    """Stream ``texts`` as tokens (waiting ``delay_s`` before each, and for ``gates[i]``
    before token i), then done with their concatenation."""

    def script(reply: Reply, request: dict) -> None:
        for index, text in enumerate(texts):
            if gates and index in gates:
                gates[index].wait(timeout=10)
            time.sleep(delay_s)
            extra = {}
            if request.get("logprobs"):
                extra = {"logprob": -0.25, "top_logprobs": [[index + 10, text, -0.25]]}
            reply.token(text, [index + 10], **extra)
        reply.done("".join(texts))

    return script


def endless(delay_s: float = 0.005):
    """Tokens until the client cancels, then done with finish_reason cancelled."""

    def script(reply: Reply, request: dict) -> None:
        sent = []
        while not reply.cancelled.wait(timeout=delay_s):
            text = f"word{len(sent)} "
            reply.token(text, [len(sent)])
            sent.append(text)
        reply.done("".join(sent), finish_reason="cancelled")

    return script


def fail(code: str, message: str):
    def script(reply: Reply, request: dict) -> None:
        reply.error(code, message)

    return script


# ---- the server -------------------------------------------------------------------------------


class FakeDaemon:
    """Serves the protocol at ``socket_path`` until ``stop()``; one thread per connection."""

    def __init__(self, socket_path: str, ask_script=None, status: dict | None = None,
                 models: list[dict] | None = None):
        self.socket_path = socket_path
        self.ask_script = ask_script or answer("Hello", ",", " world")
        self.status = status or {}
        self.models = models or []
        self.requests: list[dict] = []  # every request received, in arrival order
        self.cancel_received = threading.Event()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._threads: list[threading.Thread] = []
        self._connections: list[socket.socket] = []
        self._stopping = False

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> "FakeDaemon":
        self._listener.bind(self.socket_path)
        self._listener.listen(8)
        self._spawn(self._accept_loop)
        return self

    def stop(self) -> None:
        self._stopping = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for connection in self._connections:  # as when a daemon dies: its clients see EOF
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in self._threads:
            thread.join(timeout=2)
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)

    def __enter__(self) -> "FakeDaemon":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    # ---- serving --------------------------------------------------------------------------

    def requests_with(self, op: str) -> list[dict]:
        return [request for request in list(self.requests) if request.get("op") == op]

    def _accept_loop(self) -> None:
        while not self._stopping:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            self._connections.append(connection)
            self._spawn(self._serve, connection)

    def _serve(self, connection: socket.socket) -> None:
        send_lock = threading.Lock()
        cancel_events: dict = {}

        def send(message: dict) -> None:
            with send_lock:
                try:
                    send_frame(connection, message)
                except OSError:
                    pass  # the client has gone; a real daemon would cancel, we just stop talking

        with connection:
            while True:
                try:
                    request = recv_frame(connection)
                except OSError:
                    return
                if request is None:
                    # The client closed: whatever is still streaming counts as abandoned.
                    for event in cancel_events.values():
                        event.set()
                    return
                self.requests.append(request)
                self._dispatch(request, send, cancel_events)

    def _dispatch(self, request: dict, send, cancel_events: dict) -> None:
        op, request_id = request.get("op"), request.get("id")
        if op == "hello":
            send({"event": "hello", "id": request_id, "protocol": 1, "server": "colibrid 0.1.0",
                  "model": "fake-moe", "max_frame_bytes": 1 << 20})
        elif op == "ask":
            cancel_events[request_id] = threading.Event()
            reply = Reply(send, request_id, cancel_events[request_id])
            self._spawn(self.ask_script, reply, request)
        elif op == "cancel":
            self.cancel_received.set()
            if request.get("target") in cancel_events:
                cancel_events[request["target"]].set()
            send({"event": "ok", "id": request_id})
        elif op == "status":
            send({"event": "status", "id": request_id, **self.status})
        elif op == "models":
            send({"event": "models", "id": request_id, "models": self.models})
        else:
            send({"event": "error", "id": request_id, "code": "unknown_op", "message": op})
