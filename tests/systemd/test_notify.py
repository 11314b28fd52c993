"""sd_notify against a real datagram socket: READY=1 only once the socket answers, STATUS= lines,
WATCHDOG=1 at half of WATCHDOG_USEC while the engine makes progress, STOPPING=1 on SIGTERM."""

from __future__ import annotations

import os
import signal
import time

from colibrid.system.systemd_notify import Notifier, watchdog_interval_s
from tests.daemon.wire import WireClient
from tests.systemd.notify_socket import NotifySocket


def test_without_notify_socket_every_call_is_a_no_op(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    notifier = Notifier()
    assert not notifier.enabled
    notifier.ready("x"), notifier.status("y"), notifier.reloading(), notifier.watchdog(), notifier.stopping()


def test_messages_as_sd_notify_3_spells_them(monkeypatch, work_dir):
    receiver = NotifySocket(work_dir / "n.sock")
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", str(receiver.path))
        notifier = Notifier()
        notifier.ready("serving")
        notifier.status("serving")  # unchanged: not sent again
        notifier.status("busy")
        notifier.reloading("reloading")
        notifier.watchdog()
        notifier.stopping("bye")
        time.sleep(0.3)
        messages = [lines for _, lines in receiver.messages]
    finally:
        receiver.close()
    assert messages[0] == ["READY=1", "STATUS=serving"]
    assert messages[1] == ["STATUS=busy"]
    assert messages[2][0] == "RELOADING=1" and messages[2][1].startswith("MONOTONIC_USEC=")
    assert abs(int(messages[2][1].split("=")[1]) - time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000) < 5e6
    assert messages[3:] == [["WATCHDOG=1"], ["STOPPING=1", "STATUS=bye"]]


def test_the_watchdog_interval_is_half_of_watchdog_usec_and_only_for_this_pid(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert watchdog_interval_s() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_interval_s() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # meant for our parent, say
    assert watchdog_interval_s() is None
    monkeypatch.delenv("WATCHDOG_USEC")
    assert watchdog_interval_s() is None


def test_ready_comes_once_the_socket_answers_then_status_watchdog_and_stopping(start_service, notify_socket, work_dir):
    service = start_service(env={"NOTIFY_SOCKET": str(notify_socket.path), "WATCHDOG_USEC": "200000"})
    notify_socket.wait_for("READY=1")
    # READY=1 promises a client is answered now: no waiting, no retrying.
    with WireClient(work_dir / "colibrid.sock", timeout_s=2) as client:
        assert client.hello()["event"] == "hello"
    lines = notify_socket.lines()
    assert any(line.startswith("STATUS=loading ") for line in lines[:lines.index("READY=1")]), lines
    status = next(line for line in lines[lines.index("READY=1"):] if line.startswith("STATUS="))
    assert status.startswith("STATUS=serving demo: 0 running, 0 waiting")

    # WATCHDOG_USEC=200 ms: a ping every 100 ms.
    start = time.monotonic()
    time.sleep(1.5)
    pings = [t for t in notify_socket.times_of("WATCHDOG=1") if t >= start]
    assert 10 <= len(pings) <= 18, len(pings)
    gaps = [b - a for a, b in zip(pings, pings[1:])]
    assert max(gaps) < 0.3, gaps

    service.proc.send_signal(signal.SIGTERM)
    notify_socket.wait_for("STOPPING=1")
    assert service.proc.wait(20) == 0
    assert not (work_dir / "colibrid.sock").exists()


def test_a_stuck_engine_stops_the_watchdog_pings_until_it_makes_progress_again(start_service, notify_socket, work_dir):
    # A prompt of 1200 tokens takes the demo engine on its portable (scalar) kernels seconds to
    # process before its first token (on the vector kernels it came to under a second once
    # attention ran in blocks): with stall_timeout_s = 0.3 that is an engine making no progress
    # on an accepted request.
    service = start_service("--stall-timeout-s", "0.3",
                            env={"NOTIFY_SOCKET": str(notify_socket.path), "WATCHDOG_USEC": "100000",
                                 "COLIBRI_KERNELS": "portable"})
    notify_socket.wait_for("READY=1")
    time.sleep(0.5)
    with WireClient(work_dir / "colibrid.sock") as client:
        client.hello()
        asked_at = time.monotonic()
        client.ask("slow", prompt="the quick brown fox " * 120, max_tokens=1)
        tokens, done = client.collect("slow")
        done_at = time.monotonic()
    assert done["event"] == "done" and done["usage"]["prompt_tokens"] >= 1000, done
    time.sleep(0.5)
    returncode, stderr = service.stop()
    assert returncode == 0

    assert done_at - asked_at > 1.0, f"the prompt was processed too fast to look stuck: {done_at - asked_at:.2f} s"
    pings = [t for t in notify_socket.times_of("WATCHDOG=1")]
    during = [t for t in pings if asked_at + 0.4 < t < done_at - 0.2]
    assert during == [], "pings went on while the engine made no progress"
    assert sum(1 for t in pings if t < asked_at) >= 3, "pings before the request"
    assert sum(1 for t in pings if t > done_at) >= 3, "pings resumed after the request"
    assert "watchdog pings stopped" in stderr and "watchdog pings resumed" in stderr
