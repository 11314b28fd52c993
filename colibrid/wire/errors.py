"""What goes wrong on the wire, seen from each end (docs/protocol.md, `error` event).

The daemon refuses a client's frame or request with a ProtocolError: its `code` is one of the
protocol's error codes, and the `error` event it becomes says which. A client refuses what the
daemon sends with a ProtocolViolation, and raises the other ClientErrors for a daemon that
cannot be reached or that answered a request with an `error` event.
"""

from __future__ import annotations

from typing import Any, Union

RequestId = Union[str, int]

# Errors after which the server cannot trust the byte stream or the client, so it closes the
# connection; every other error ends only the request it names.
CONNECTION_CLOSING_CODES = frozenset({"bad_frame", "frame_too_large", "bad_request", "unknown_op",
                                      "unsupported_protocol", "forbidden", "timeout"})


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


class ClientError(Exception):
    """Base of everything a client of the protocol raises on purpose."""


class ProtocolViolation(ClientError):
    """The daemon sent something the protocol does not allow (a bad frame, a malformed or stray event)."""


class DaemonUnreachable(ClientError):
    """No daemon answered at ``socket_path``, or it went away mid-conversation."""

    def __init__(self, socket_path: str, reason: str):
        self.socket_path = socket_path
        self.reason = reason
        super().__init__(f"cannot reach colibrid at {socket_path}: {reason}")


class RequestError(ClientError):
    """The daemon answered a request with an ``error`` event (``code`` as in the protocol)."""

    def __init__(self, code: str, message: str, request_id: Any = None):
        self.code = code
        self.message = message
        self.request_id = request_id
        super().__init__(f"[{code}] {message}")
