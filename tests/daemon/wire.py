"""A deliberately small client for the tests: raw socket + msgpack, written from docs/protocol.md.

It does not import colibrictl or colibrid, so the daemon is held against the document, not
against code that might share its mistakes.
"""

from __future__ import annotations

import signal
import socket
import struct
import subprocess
import time
from pathlib import Path
from typing import Any

import msgpack

TIMEOUT_S = 20.0


class Closed(Exception):
    """The server closed the connection."""


class WireClient:
    def __init__(self, socket_path: Path, timeout_s: float = TIMEOUT_S) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.sock.connect(str(socket_path))
        self._buffer = b""

    def __enter__(self) -> "WireClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    # -- sending ---------------------------------------------------------------------------

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(self, message: dict[str, Any]) -> None:
        body = msgpack.packb(message, use_bin_type=True)
        self.send_raw(struct.pack(">I", len(body)) + body)

    # -- receiving -------------------------------------------------------------------------

    def _read_exactly(self, n: int) -> bytes:
        while len(self._buffer) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise Closed()
            self._buffer += chunk
        data, self._buffer = self._buffer[:n], self._buffer[n:]
        return data

    def recv(self) -> dict[str, Any]:
        (length,) = struct.unpack(">I", self._read_exactly(4))
        return msgpack.unpackb(self._read_exactly(length), raw=False)

    def is_closed_by_server(self) -> bool:
        """True once the server has closed its side (after any frames still to read)."""
        try:
            self.recv()
        except (Closed, ConnectionResetError):
            return True
        return False

    # -- conversations ---------------------------------------------------------------------

    def hello(self, request_id: Any = "hello") -> dict[str, Any]:
        self.send({"op": "hello", "id": request_id, "protocol": 1, "client": "tests"})
        return self.recv()

    def ask(self, request_id: Any, prompt: str = "def fibonacci(n):", **fields: Any) -> None:
        self.send({"op": "ask", "id": request_id, "prompt": prompt, "raw": True, "temperature": 0, **fields})

    def collect(self, request_id: Any) -> tuple[list[dict], dict]:
        """Events of one request up to its done or error, skipping nothing: others' events fail the test."""
        tokens = []
        while True:
            event = self.recv()
            assert event["id"] == request_id, f"expected events of {request_id!r}, got {event}"
            if event["event"] == "token":
                tokens.append(event)
            else:
                return tokens, event

    def ends_until_closed(self) -> dict[Any, dict]:
        """The last event (done or error) of every request, read until the server closes."""
        ends = {}
        try:
            while True:
                event = self.recv()
                if event["event"] != "token":
                    ends[event["id"]] = event
        except (Closed, ConnectionResetError):
            pass
        return ends

    def collect_all(self, request_ids: list[Any]) -> dict[Any, tuple[list[dict], dict]]:
        """Events of several requests on this connection, sorted by id, until each has ended."""
        tokens: dict[Any, list[dict]] = {rid: [] for rid in request_ids}
        ends: dict[Any, dict] = {}
        while len(ends) < len(request_ids):
            event = self.recv()
            assert event["id"] in tokens and event["id"] not in ends, f"unexpected event {event}"
            if event["event"] == "token":
                tokens[event["id"]].append(event)
            else:
                ends[event["id"]] = event
        return {rid: (tokens[rid], ends[rid]) for rid in request_ids}


def stop_process(proc, timeout_s: float) -> tuple[int, str]:
    """SIGTERM (if still running), then the exit code and everything it wrote to stderr."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, stderr = proc.communicate()
        raise
    return proc.returncode, stderr


def wait_for_socket(path: Path, proc, timeout_s: float = 30.0) -> None:
    """Until something accepts connections at `path`; fails early if the daemon exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"colibrid exited with {proc.returncode}: {proc.stderr.read()}")
        if path.exists():
            try:
                with WireClient(path, timeout_s=1.0):
                    return
            except OSError:
                pass
        time.sleep(0.02)
    raise TimeoutError(f"colibrid did not listen on {path} within {timeout_s} s")
