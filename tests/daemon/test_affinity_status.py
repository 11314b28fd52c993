"""The daemon's status reports the CPUs it pinned its threads to and its niceness."""

from __future__ import annotations

import os

from colibrid.system.affinity import parse_cpu_list
from tests.daemon.wire import WireClient


def test_status_shows_the_cpus_and_niceness(start_daemon):
    daemon = start_daemon("--cpu-affinity", "0", "--nice", "5")
    with WireClient(daemon.socket_path) as client:
        client.hello()
        client.send({"op": "status", "id": "s"})
        status = client.recv()
    assert status["cpus"]["compute"] == "0" and status["nice"] == 5
    assert set(parse_cpu_list(status["cpus"]["io"])) <= os.sched_getaffinity(0)
