"""Log lines carry sd-daemon priority prefixes when stderr is the journal's stream, and not otherwise."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.daemon.wire import WireClient, wait_for_socket


def run_with_stderr_pipe(demo_pack, work_dir, journal_stream: str | None, *flags: str) -> list[str]:
    read_end, write_end = os.pipe()
    stat = os.fstat(write_end)
    env = {k: v for k, v in os.environ.items() if k != "JOURNAL_STREAM"}
    if journal_stream == "this pipe":
        env["JOURNAL_STREAM"] = f"{stat.st_dev}:{stat.st_ino}"  # what systemd sets for a journal stream
    elif journal_stream is not None:
        env["JOURNAL_STREAM"] = journal_stream
    proc = subprocess.Popen([sys.executable, "-m", "colibrid", "--model", str(demo_pack),
                             "--socket", str(work_dir / "s.sock"), "--hugepage-record", str(work_dir / "hugepages.json"),
                             *flags],
                            stdout=subprocess.DEVNULL, stderr=write_end, env=env)
    os.close(write_end)
    try:
        proc.stderr = open(os.devnull)  # for wait_for_socket's message on an early exit
        wait_for_socket(work_dir / "s.sock", proc)
        with WireClient(work_dir / "s.sock") as client:
            client.hello()
            client.send({"op": "bogus", "id": 1})  # an unknown op: a debug line, then the connection closes
            client.is_closed_by_server()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    with open(read_end) as stderr:
        return stderr.read().splitlines()


def test_under_the_journal_each_line_starts_with_its_priority(demo_pack, work_dir):
    lines = run_with_stderr_pipe(demo_pack, work_dir, "this pipe", "--log-level", "debug")
    assert lines, "nothing logged"
    assert all(line[:3] in ("<3>", "<4>", "<6>", "<7>") for line in lines), lines
    assert any(line.startswith("<6>serving demo (") for line in lines)
    assert any(line.startswith("<7>colibrid.daemon.connection: connection 1 (uid ") for line in lines)
    assert lines[-1] == "<6>stopped"


def test_on_a_terminal_or_a_redirected_stderr_lines_are_for_people(demo_pack, work_dir):
    # JOURNAL_STREAM inherited from a parent whose stderr went to the journal, but ours does not.
    lines = run_with_stderr_pipe(demo_pack, work_dir, "8:12345")
    # (Raising vm.nr_hugepages, when the machine has none reserved, is logged before serving.)
    assert all(line.startswith("colibrid: ") for line in lines), lines
    assert any(line.startswith("colibrid: serving demo (") for line in lines) and lines[-1] == "colibrid: stopped"
