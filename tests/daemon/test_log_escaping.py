"""Text from clients never forges log lines: a record's message is one printable line in both
log formats (terminal and journald), whatever a client put in its name, ids or prompt."""

from __future__ import annotations

import logging
import re
import sys

import pytest

from colibrid.system.logsetup import JournalFormatter, TerminalFormatter
from tests.daemon.wire import WireClient

FORGED_NAME = "tests\ncolibrid: error: forged line from the client name\r\x1b[2J"
FORGED_ID = "id\n<3>forged journal entry\x1b]0;title\x07\u2028\x85"


def _record(message: str, *args, exc_info=None) -> logging.LogRecord:
    return logging.LogRecord("colibrid.daemon.server", logging.INFO, __file__, 1, message, args, exc_info)


def test_a_client_cannot_forge_a_log_line_or_send_terminal_escapes(start_daemon):
    daemon = start_daemon("--log-level", "debug")
    with WireClient(daemon.socket_path) as client:
        client.send({"op": "hello", "id": "hello", "protocol": 1, "client": FORGED_NAME})
        assert client.recv()["event"] == "hello"
        client.ask(FORGED_ID, max_tokens=1)
        assert client.collect(FORGED_ID)[1]["event"] == "done"
    returncode, stderr = daemon.terminate()
    assert returncode == 0, stderr
    assert not any(control in stderr for control in ("\r", "\x1b", "\x07", "\u2028", "\x85")), stderr
    forged_lines = [line for line in stderr.splitlines() if "forged" in line]
    assert forged_lines, stderr  # the client's text is logged (at debug level), but within our own lines
    # Each is one of our own lines (at debug: the hello and the ask; at info, shown without level
    # and logger: the finished request), which the client's text only continues.
    ours = re.compile(r"colibrid: (debug: colibrid(\.\w+)+: )?(connection \d+ |request ')")
    assert all(ours.match(line) for line in forged_lines), forged_lines
    assert any("hello from tests\\x0acolibrid: error: forged" in line for line in forged_lines), forged_lines


@pytest.mark.parametrize("formatter", [TerminalFormatter(), JournalFormatter()], ids=["terminal", "journal"])
def test_every_control_character_in_a_message_is_escaped(formatter):
    controls = "".join(map(chr, [*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029, 0x202E, 0x2066]))
    line = formatter.format(_record("hello from %s, ask %r", controls + "<3>x", FORGED_ID))
    assert len(line.splitlines()) == 1
    assert not any(char in line for char in controls), repr(line)
    assert "\\x09\\x0a\\x0b" in line and "\\u202e\\u2066<3>x" in line


def test_journal_lines_keep_their_own_priority_only(monkeypatch):
    line = JournalFormatter().format(_record("%s", "fine\n<3>forged error"))
    assert line == "<6>fine\\x0a<3>forged error"


def test_a_traceback_still_spans_lines_after_the_escaped_message():
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = _record("request %r failed", "a\nb", exc_info=sys.exc_info())
    lines = JournalFormatter().format(record).splitlines()
    assert lines[0] == "<6>request 'a\\nb' failed"
    assert lines[-1] == "<6>RuntimeError: boom" and len(lines) > 2


def test_escaping_leaves_printable_text_alone():
    from colibrid.system.logsetup import escape_controls

    assert escape_controls("serving model — 42 °C, café 中文 \\n") == "serving model — 42 °C, café 中文 \\n"
