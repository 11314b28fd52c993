"""SIGTERM drains: accepted requests finish within shutdown_grace_s, or end with `shutdown` after it."""

from __future__ import annotations

import contextlib
import signal
import time

from tests.daemon.wire import WireClient, wait_for_socket


RUNNING_TOKENS = 600


def test_requests_accepted_before_sigterm_finish_and_new_ones_are_refused(start_service, work_dir):
    service = start_service("--shutdown-grace-s", "30")
    wait_for_socket(work_dir / "colibrid.sock", service.proc)
    with WireClient(work_dir / "colibrid.sock") as client:
        client.hello()
        # Long enough to still be running well after SIGTERM has been handled, however fast the kernels.
        client.ask("running", max_tokens=RUNNING_TOKENS)
        client.ask("queued", max_tokens=5)
        assert client.recv()["event"] == "token"
        service.proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        client.ask("late", max_tokens=5)
        ends = client.ends_until_closed()
    assert ends["running"]["event"] == "done" and ends["running"]["finish_reason"] == "length"
    assert ends["running"]["usage"]["generated_tokens"] == RUNNING_TOKENS
    assert ends["queued"]["event"] == "done"
    assert (ends["late"]["event"], ends["late"]["code"]) == ("error", "shutdown")
    assert service.proc.wait(20) == 0
    assert not (work_dir / "colibrid.sock").exists()


@contextlib.contextmanager
def sigterm_during_a_long_ask(start_service, work_dir, grace_s: str):
    """A service with shutdown_grace_s = grace_s that has just been sent SIGTERM while it
    streams a long ask ("long"): yields the service and the client."""
    service = start_service("--shutdown-grace-s", grace_s)
    wait_for_socket(work_dir / "colibrid.sock", service.proc)
    with WireClient(work_dir / "colibrid.sock") as client:
        client.hello()
        client.ask("long", max_tokens=3000)
        assert client.recv()["event"] == "token"
        service.proc.send_signal(signal.SIGTERM)
        yield service, client


def test_what_is_not_finished_after_the_grace_period_ends_with_shutdown(start_service, work_dir):
    with sigterm_during_a_long_ask(start_service, work_dir, "1") as (service, client):
        signalled = time.monotonic()
        ends = client.ends_until_closed()
        ended = time.monotonic()
    assert (ends["long"]["event"], ends["long"]["code"]) == ("error", "shutdown")
    assert 0.9 < ended - signalled < 5.0
    assert service.proc.wait(20) == 0


def test_a_second_sigterm_ends_the_grace_period_at_once(start_service, work_dir):
    with sigterm_during_a_long_ask(start_service, work_dir, "60") as (service, client):
        time.sleep(0.5)
        service.proc.send_signal(signal.SIGTERM)
        ends = client.ends_until_closed()
    assert ends["long"]["code"] == "shutdown"
    assert service.proc.wait(20) == 0
