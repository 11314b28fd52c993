"""A fleet behind a real load balancer: two colibrid + colibri-openai pairs behind HAProxy
(health checks on /health, least-connections routing). The openai client sends 16 requests at
once; one pair is killed mid-run. Every request either completes or fails with a status a
client may retry, none hangs, and none is answered twice."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from tests.daemon.conftest import DaemonProcess
from tests.gateway.conftest import GatewayProcess

openai = pytest.importorskip("openai")
HAPROXY = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None)
pytestmark = pytest.mark.skipif(HAPROXY is None, reason="HAProxy is not installed (Debian: apt-get install haproxy); "
                                                        "the fleet test needs a real load balancer")

REQUESTS = 16
KILL_AFTER_COMPLETED = 3
RETRYABLE_STATUSES = {429, 502, 503, 504}
REQUEST_TIMEOUT_S = 60.0

HAPROXY_CONFIG = """\
global
    maxconn 256
defaults
    mode http
    timeout connect 2s
    timeout client {timeout_s}s
    timeout server {timeout_s}s
    # A connection refused by a dead backend is tried again on the other one. Only connection
    # failures are retried (retry-on's default): a request a backend received is never sent twice.
    retries 2
    option redispatch
frontend api
    bind 127.0.0.1:{port}
    default_backend colibri
backend colibri
    balance leastconn
    option httpchk GET /health
    http-check expect status 200
    default-server inter 200ms fall 1 rise 1
{servers}
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Pair:
    def __init__(self, pack: Path, directory: Path) -> None:
        self.daemon = DaemonProcess(pack, directory / "colibrid.sock")
        self.gateway = GatewayProcess(self.daemon.socket_path)

    def kill(self) -> None:
        self.gateway.proc.kill()
        self.daemon.proc.kill()

    def stop(self) -> None:
        from colibrid.system.memory import HugepageRecord, return_orphaned_hugepages

        if self.gateway.proc.poll() is None:
            self.gateway.proc.kill()
        self.gateway.proc.communicate()
        self.daemon.terminate()  # a running daemon gives back the hugepages it raised
        # One killed mid-run could not: its next start would return them from its record, so do that here
        return_orphaned_hugepages(HugepageRecord(self.daemon.hugepage_record))


@pytest.fixture
def fleet(demo_pack):
    directory = Path(tempfile.mkdtemp(prefix="colibri-fleet-"))
    pairs, balancer = [], None
    try:
        for name in ("a", "b"):
            (directory / name).mkdir()
            pairs.append(Pair(demo_pack, directory / name))
        port = _free_port()
        servers = "\n".join(f"    server {name} {pair.gateway.url.removeprefix('http://')} check"
                            for name, pair in zip("ab", pairs))
        config = directory / "haproxy.cfg"
        config.write_text(HAPROXY_CONFIG.format(port=port, servers=servers, timeout_s=int(REQUEST_TIMEOUT_S)))
        balancer = subprocess.Popen([HAPROXY, "-db", "-f", str(config)], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert balancer.poll() is None, balancer.stdout.read()
            assert time.monotonic() < deadline, "HAProxy did not come up"
            time.sleep(0.1)
        yield url, pairs
    finally:
        if balancer is not None:
            balancer.kill()
            balancer.communicate()
        for pair in pairs:
            pair.stop()
        shutil.rmtree(directory, ignore_errors=True)


def test_a_backend_killed_mid_run_costs_retryable_failures_only(fleet):
    url, (first, second) = fleet
    completed: list[str] = []
    killed_at_s: list[float] = []

    async def one(client, index: int) -> tuple[str, object]:
        try:
            completion = await client.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": f"request {index}"}], temperature=0, max_tokens=24)
        except openai.APIStatusError as error:
            return "failed", error.status_code
        completed.append(completion.id)
        if len(completed) == KILL_AFTER_COMPLETED:
            first.kill()
            killed_at_s.append(time.monotonic())
        return "completed", (completion.id, time.monotonic())

    async def run_all():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0,
                                      timeout=REQUEST_TIMEOUT_S) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(REQUESTS))),
                                          REQUEST_TIMEOUT_S * 1.5)

    results = asyncio.run(run_all())  # a hung request would fail here, by the timeout

    assert killed_at_s, "the run ended before a backend could be killed"
    statuses = [detail for outcome, detail in results if outcome == "failed"]
    assert set(statuses) <= RETRYABLE_STATUSES, statuses
    answers = [detail for outcome, detail in results if outcome == "completed"]
    assert len(answers) + len(statuses) == REQUESTS
    assert len({completion_id for completion_id, _ in answers}) == len(answers), "a request was answered twice"
    assert any(done_s > killed_at_s[0] for _, done_s in answers), "nothing was served by the survivor after the kill"
    # The survivor keeps serving once the balancer has seen the dead one go.
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
    for _ in range(3):
        assert client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "after"}],
                                              max_tokens=2).choices
    assert second.daemon.proc.poll() is None
