"""Where colibrid's log lines go and what they look like: stderr, in one of two formats.

On a terminal, a person reads `colibrid: message` (`warning: ` and `debug: ` said in words).
Under systemd, stderr is a stream into journald, which stores each line as one entry with a
priority; a line that begins with `<N>` (sd-daemon(3): <3> error, <4> warning, <6> info,
<7> debug) gets priority N instead of the unit's default. So there the lines carry that prefix
and no `colibrid: ` (the journal already names the unit), and `journalctl -p warning` works.

Which one is decided by JOURNAL_STREAM, set by systemd to the device and inode of the stream
it connected to stderr: if stderr is still that stream the journal reads it (systemd.exec(5)
recommends exactly this check; a child with a redirected stderr inherits the variable but not
the stream, and must not print prefixes to a terminal or a file).

A record's message is always one line, whoever wrote its arguments: a client's name, request
id or prompt may hold a newline (a forged next line, or a forged `<3>` priority in the journal),
a carriage return or ESC sequences for the terminal that reads the log. Both formatters escape
every control character of the formatted message (C0, DEL, C1, the Unicode line and paragraph
separators, bidirectional overrides) as \\xNN / \\uNNNN - in one place, so no call site can
forget it. Only a traceback (exc_info) adds lines, after the escaped message.
"""

from __future__ import annotations

import logging
import os
import sys

# sd-daemon(3) priorities, the same numbers as syslog's.
_PRIORITIES = ((logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6))
_DEBUG_PRIORITY = 7


def _escape_table() -> dict[int, str]:
    controls = [*range(0x00, 0x20), *range(0x7F, 0xA0)]  # C0, DEL, C1 (NEL is U+0085)
    controls += [0x2028, 0x2029]  # line and paragraph separators: line breaks to some readers
    controls += [*range(0x202A, 0x202F), *range(0x2066, 0x206A)]  # bidi overrides: text that reads backwards
    return {code: f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}" for code in controls}


_ESCAPES = _escape_table()


def escape_controls(text: str) -> str:
    """`text` with every control character written out (\\n for a newline, \\x1b for ESC): one printable line."""
    return text.translate(_ESCAPES)


def one_line_message(record: logging.LogRecord) -> str:
    """The record's message (msg % args) with its control characters escaped."""
    return escape_controls(record.getMessage())


def stderr_is_journal() -> bool:
    stream = os.environ.get("JOURNAL_STREAM", "")
    device, _, inode = stream.partition(":")
    if not (device.isdigit() and inode.isdigit()):
        return False
    try:
        stat = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    return (stat.st_dev, stat.st_ino) == (int(device), int(inode))


class TerminalFormatter(logging.Formatter):
    """`colibrid: message`, the level only when it is not plain information: one line a user can read."""

    def format(self, record: logging.LogRecord) -> str:
        message = one_line_message(record)
        if record.levelno == logging.WARNING:
            message = "warning: " + message
        elif record.levelno == logging.DEBUG:
            message = f"debug: {record.name}: {message}"
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        return "colibrid: " + message


class JournalFormatter(logging.Formatter):
    """`<priority>message`; every line of a multi-line record gets the prefix (journald splits on newlines)."""

    def format(self, record: logging.LogRecord) -> str:
        priority = next((number for level, number in _PRIORITIES if record.levelno >= level), _DEBUG_PRIORITY)
        message = one_line_message(record)
        if record.levelno == logging.DEBUG:
            message = f"{record.name}: {message}"
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        return "\n".join(f"<{priority}>{line}" for line in message.splitlines() or [""])


def configure_logging(level: str) -> None:
    """One handler on the root logger, writing to stderr in the format for where stderr goes."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JournalFormatter() if stderr_is_journal() else TerminalFormatter())
    logging.getLogger().handlers[:] = [handler]
    set_level(level)


def set_level(level: str) -> None:
    """Also on reload: the configured level for colibrid, the engine one step quieter."""
    logging.getLogger().setLevel(level.upper())
    # The engine logs its own "loaded ..." line; the daemon's startup line says the same and more.
    logging.getLogger("colibrid.engine").setLevel(logging.DEBUG if level == "debug" else logging.WARNING)
