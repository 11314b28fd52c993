"""What a hostile client costs colibrid and the other clients: the scenarios of docs/security.md
"Clients", each against a fresh colibrid, bounded in count and time, on this machine only.

Not a test (the tests assert the limits in tests/daemon/test_client_limits.py); this prints the
numbers docs/performance.md quotes:

    python bench/bench_hostile_clients.py                        # every scenario, a demo pack
    python bench/bench_hostile_clients.py pipeline --pack PACK   # one scenario, another pack

  pipeline  one client pipelines 20,000 `status` requests and never reads: how long another
            client waits for its hello, how much of the pipeline the daemon took, its RSS
  bigid     five unread asks with a 900 kB id: the daemon's peak RSS over 15 s
  idle      1,100 idle connections against a daemon whose open-files limit is 1024: a new
            client's hello, the daemon's log lines and tracebacks
  prompt    20 raw prompts of 1 MB: engine time and the daemon's RSS after them
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_process import ServerProcess  # noqa: E402

HELLO = {"op": "hello", "id": 0, "protocol": 1}


def frame(message: dict) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def receive(sock: socket.socket) -> dict:
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise EOFError("the daemon closed the connection")
            data += chunk
        return data

    (length,) = struct.unpack(">I", exactly(4))
    return msgpack.unpackb(exactly(length), raw=False)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Daemon(ServerProcess):
    """colibrid on `pack`, its socket and log in a temporary directory; optional open-files limit."""

    def __init__(self, pack: Path, open_files: int | None = None) -> None:
        super().__init__("colibri-hostile-")
        self.socket_path = str(self.dir / "colibrid.sock")
        argv = [sys.executable, "-m", "colibrid", "--model", str(pack), "--socket", self.socket_path,
                "--hugepage-record", str(self.dir / "hugepages.json")]
        if open_files is not None:
            argv = ["prlimit", f"--nofile={open_files}", *argv]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and hello_latency(self.socket_path, 1.0)[1] != "hello":
            if self.proc.poll() is not None:
                raise RuntimeError(f"colibrid exited during start-up: {self.stop()}")
            time.sleep(0.05)

    def connect(self, timeout_s: float = 5.0) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX)
        sock.settimeout(timeout_s)
        sock.connect(self.socket_path)
        return sock

    def stop(self) -> str:
        """SIGTERM (SIGKILL after 30 s); its log."""
        return super().stop(30.0)


def connect_when_the_backlog_has_room(socket_path: str, timeout_s: float) -> socket.socket | None:
    """A connected socket, or None if the daemon's backlog stayed full for timeout_s (a Unix
    socket with a timeout is non-blocking underneath: a full backlog fails at once with EAGAIN)."""
    deadline = time.monotonic() + timeout_s
    while True:
        sock = socket.socket(socket.AF_UNIX)
        sock.settimeout(timeout_s)
        try:
            sock.connect(socket_path)
            return sock
        except BlockingIOError:
            sock.close()
            if time.monotonic() > deadline:
                return None
            time.sleep(0.01)


def hello_latency(socket_path: str, timeout_s: float = 60.0) -> tuple[float, str]:
    """Seconds from connect() to the answer to a hello, and what the answer was."""
    started = time.monotonic()
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(timeout_s)
    try:
        sock.connect(socket_path)
        sock.sendall(frame(HELLO))
        answer = receive(sock)
        outcome = answer["event"] if answer["event"] != "error" else f"error {answer['code']}"
    except (OSError, EOFError) as exc:
        outcome = type(exc).__name__
    finally:
        sock.close()
    return time.monotonic() - started, outcome


def pipeline(pack: Path) -> None:
    daemon = Daemon(pack)
    flood = daemon.connect()
    flood.sendall(frame(HELLO))
    requests = b"".join(frame({"op": "status", "id": i}) for i in range(1, 20_001))
    taken = [0]

    def send_without_reading() -> None:
        view = memoryview(requests)
        try:
            while taken[0] < len(requests):
                taken[0] += flood.send(view[taken[0]:taken[0] + 65536])
        except OSError:
            pass  # blocked past the socket timeout: the daemon stopped reading, as it should

    threading.Thread(target=send_without_reading, daemon=True).start()
    time.sleep(0.3)
    seconds, outcome = hello_latency(daemon.socket_path)
    time.sleep(2)
    print(f"pipeline: another client's hello {seconds:.3f} s ({outcome}); the daemon took {taken[0]:,} of "
          f"{len(requests):,} bytes of requests; RSS {rss_mb(daemon.proc.pid):.0f} MB")
    flood.close()
    daemon.stop()


def bigid(pack: Path) -> None:
    daemon = Daemon(pack)
    start_mb = rss_mb(daemon.proc.pid)
    client = daemon.connect()
    client.sendall(frame(HELLO))
    for i in range(5):
        try:
            client.sendall(frame({"op": "ask", "id": str(i) * 900_000, "prompt": "def f(x):", "raw": True,
                                  "temperature": 0, "max_tokens": 256}))
        except OSError:
            break  # the daemon closed the connection
    peak_mb, deadline = start_mb, time.monotonic() + 15
    while time.monotonic() < deadline:
        peak_mb = max(peak_mb, rss_mb(daemon.proc.pid))
        time.sleep(0.2)
    seconds, outcome = hello_latency(daemon.socket_path)
    print(f"bigid: RSS {start_mb:.0f} MB at start, {peak_mb:.0f} MB at the peak over 15 s; "
          f"another client's hello {seconds:.3f} s ({outcome})")
    client.close()
    daemon.stop()


def idle(pack: Path) -> None:
    daemon = Daemon(pack, open_files=1024)
    connections = []
    for _ in range(1100):
        sock = connect_when_the_backlog_has_room(daemon.socket_path, timeout_s=2.0)
        if sock is None:
            break  # the backlog stayed full: the daemon accepts no more
        connections.append(sock)
    time.sleep(3)
    seconds, outcome = hello_latency(daemon.socket_path, timeout_s=10)
    rss = rss_mb(daemon.proc.pid)
    for sock in connections:
        sock.close()
    log = daemon.stop()
    print(f"idle: {len(connections)} connections open; a new client's hello {seconds:.3f} s ({outcome}); "
          f"RSS {rss:.0f} MB; {log.count(chr(10))} log lines, {log.count('Traceback')} tracebacks")


def prompt(pack: Path, count: int = 20, size_bytes: int = 1_000_000) -> None:
    daemon = Daemon(pack)
    client = daemon.connect(timeout_s=120)
    client.sendall(frame(HELLO))
    receive(client)
    text = ("word " * (size_bytes // 5 + 1))[:size_bytes]
    started, answers = time.monotonic(), set()
    for i in range(count):
        client.sendall(frame({"op": "ask", "id": i, "prompt": text, "raw": True, "max_tokens": 1}))
        answer = receive(client)
        answers.add(answer.get("code", answer["event"]))
    print(f"prompt: {count} prompts of {size_bytes:,} bytes answered in {time.monotonic() - started:.2f} s "
          f"({', '.join(sorted(answers))}); RSS {rss_mb(daemon.proc.pid):.0f} MB")
    client.close()
    daemon.stop()


SCENARIOS = {"pipeline": pipeline, "bigid": bigid, "idle": idle, "prompt": prompt}


def demo_pack(work: Path) -> Path:
    pack = work / "demo.pack"
    subprocess.run([sys.executable, "-m", "colibrid.tools.demo", str(pack), "--force"], check=True,
                   stdout=subprocess.DEVNULL)
    return pack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenarios", nargs="*", metavar="SCENARIO", help=f"any of {', '.join(SCENARIOS)} (default: all)")
    parser.add_argument("--pack", type=Path, help="default: a random-weight demo pack built for the run")
    args = parser.parse_args()
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(sorted(unknown))}; choose from {', '.join(SCENARIOS)}")
    with tempfile.TemporaryDirectory(prefix="colibri-hostile-") as work:
        pack = args.pack or demo_pack(Path(work))
        for name in args.scenarios or SCENARIOS:
            SCENARIOS[name](pack)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
