"""What colibrid tells its operator about each request: one info line when it ends, and the
recent decoding rate in `status`."""

from __future__ import annotations

import os
import re
import time

from tests.daemon.wire import WireClient

# "colibrid: request 'a' from connection 2 (uid 0 (root) gid 0 pid 42): 9 prompt tokens, 5 generated, 310.2 tokens/s, length"
REQUEST_LINE = re.compile(r"colibrid: request (?P<id>'\w+') from (?P<peer>connection \d+ \(uid \d+ .* pid (?P<pid>\d+)\)): "
                          r"(?P<prompt>\d+) prompt tokens, (?P<generated>\d+) generated, "
                          r"(?P<rate>[0-9.]+) tokens/s, (?P<ending>[\w ]+)$")


def test_one_info_line_per_finished_request(start_daemon):
    daemon = start_daemon("--max-context", "64")
    with WireClient(daemon.socket_path) as client:
        client.hello()
        client.ask("done", max_tokens=5)
        _, done = client.collect("done")
        client.ask("cut", max_tokens=50)
        client.recv()  # its first token: it is running
        client.send({"op": "cancel", "id": "cancel", "target": "cut"})
        ends = client.collect_all(["cancel", "cut"])
        client.ask("refused", prompt="word " * 200)  # longer than the context: found by the engine thread
        _, refused = client.collect("refused")

    _, stderr = daemon.terminate()
    lines = {match["id"]: match for match in map(REQUEST_LINE.match, stderr.splitlines()) if match}
    assert set(lines) == {"'done'", "'cut'", "'refused'"}, stderr
    first = lines["'done'"]
    assert int(first["pid"]) == os.getpid()  # the peer is named by its credentials
    assert (int(first["prompt"]), int(first["generated"]), first["ending"]) == (
        done["usage"]["prompt_tokens"], done["usage"]["generated_tokens"], done["finish_reason"])
    assert float(first["rate"]) == round(done["usage"]["decode_tokens_per_s"], 1)
    cancelled = ends["cut"][1]
    assert lines["'cut'"]["ending"] == "cancelled"
    assert int(lines["'cut'"]["generated"]) == cancelled["usage"]["generated_tokens"] > 0
    assert refused["code"] == "invalid_params"
    assert lines["'refused'"]["ending"] == "error invalid_params"


def test_status_shows_the_recent_decoding_rate(start_daemon):
    daemon = start_daemon()
    with WireClient(daemon.socket_path) as client:
        client.hello()
        client.send({"op": "status", "id": "before"})
        assert client.recv()["recent_tokens_per_s"] == 0.0  # nothing generated yet

        client.ask("a", max_tokens=200)
        client.collect("a")
        # The rate is the one systemd's STATUS= line shows, measured over its ~2 s window.
        deadline, rate = time.monotonic() + 6.0, 0.0
        while rate == 0.0 and time.monotonic() < deadline:
            client.send({"op": "status", "id": "after"})
            rate = client.recv()["recent_tokens_per_s"]
            time.sleep(0.1)
    assert rate > 0.0
