"""The ``colibrictl chat`` command: a conversation with the model.

On a terminal it is interactive: readline line editing and a bounded history file, answers
streamed as they are generated, a status line (tokens, tok/s) on stderr after each one,
slash commands (/system, /reset, /save, /load, /help, /exit), Ctrl-C that stops an answer
without leaving. With stdin not a terminal it is for scripts: one turn per line, one answer
per turn on stdout, nothing else there.

Every turn sends the whole conversation (``messages``, the system prompt as ``system``): the
daemon keeps no conversation, so the client is where it lives, and /save can write it out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from colibrictl import command, conversation
from colibrid.wire.client import Connection
from colibrid.wire.errors import ClientError, DaemonUnreachable, ProtocolViolation, RequestError
from colibrid.wire.events import DoneEvent, ErrorEvent, TokenEvent, Usage
from colibrictl.conversation import Conversation, ConversationFileError

PROMPT = ">>> "
HISTORY_LINES = 1000  # what the history file keeps: the newest lines
HISTORY_FILE = ("colibri", "chat_history")  # under $XDG_STATE_HOME, else ~/.local/state

COMMANDS_HELP = """\
/system TEXT  set the system prompt (/system alone removes it)
/reset        forget the turns (the system prompt stays)
/save FILE    write the conversation to FILE (JSON: a list of messages)
/load FILE    go on with the conversation in FILE, in place of this one
/help         this list
/exit         leave (so do /quit and Ctrl-D)
//TEXT        send a line that begins with /"""
CTRL_C_HELP = "Ctrl-C stops an answer, keeping what it wrote; at the prompt it clears the line."

EPILOG = f"""\
interactive (stdin is a terminal):
  Type a line to send it; the answer streams as it is generated, then a status
  line on stderr gives its tokens, tok/s, prompt tokens and time to first token.
  Lines that begin with / are commands:
{''.join('    ' + line + chr(10) for line in COMMANDS_HELP.splitlines())}
  Ctrl-C sends `cancel` for the answer and keeps the words already written as
  the model's turn (if none were, the question is dropped too); the next turn
  goes on a fresh connection. Ctrl-C at the prompt clears the line. An error
  from the daemon (busy, thermal, ...) is shown, the question is not kept, and
  the chat goes on; so it does when the daemon is gone (the next turn tries
  again), and /save still works.
  History (readline): $XDG_STATE_HOME/colibri/chat_history, else
  ~/.local/state/colibri/chat_history; the newest {HISTORY_LINES} lines.

scripts (stdin is not a terminal):
  Each line of stdin is one turn (empty lines are skipped; commands work as
  above). Each answer goes to stdout followed by a newline (an empty answer is
  an empty line), and nothing else does. The first failure ends the chat with
  the exit status `ask` would give (a line that cannot be carried out, such as
  an unknown command or an unreadable /load file: 2), since the answers would
  no longer line up with the lines. --json: each turn's events, one JSON
  object per line, as `ask --json` prints them.
"""


class ChatLineError(Exception):
    """A line that cannot be carried out (an unknown command, a missing argument)."""


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def _write(text: str) -> None:
    """stdout, flushed now: each token appears when it is generated."""
    sys.stdout.write(text)
    sys.stdout.flush()


def _write_json(event: dict) -> None:
    _write(json.dumps(event, ensure_ascii=False, default=str) + "\n")


def _note(text: str, dim: bool = False) -> None:
    """stderr: what is said about the chat, never part of an answer. Dimmed only on a terminal."""
    if dim and sys.stderr.isatty():
        text = f"\033[2m{text}\033[0m"
    print(text, file=sys.stderr, flush=True)


def _error(text: str) -> None:
    _note(f"colibrictl: {text}")


# --------------------------------------------------------------------------------------------
# One answer
# --------------------------------------------------------------------------------------------


@dataclass
class Answer:
    """What came back for one turn."""

    text: str  # the assistant's turn: the done event's text, or what arrived before Ctrl-C
    finish_reason: str  # the daemon's, or "interrupted" (Ctrl-C)
    usage: Usage = field(default_factory=Usage)  # the done event's; zeros when interrupted
    token_count: int = 0  # tokens received in token events
    decode_s: float = 0.0  # from the first token received to the last (the client's clock)


@dataclass
class _Received:
    """An answer as it arrives."""

    parts: list[str] = field(default_factory=list)
    token_count: int = 0
    first_token_at_s: float | None = None  # time.monotonic()
    last_token_at_s: float | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def add(self, event: TokenEvent) -> None:
        now = time.monotonic()
        self.first_token_at_s = self.first_token_at_s or now
        self.last_token_at_s = now
        self.token_count += len(event.token_ids)
        self.parts.append(event.text)

    def answer(self, finish_reason: str, text: str | None = None, usage: Usage | None = None) -> Answer:
        decode_s = (self.last_token_at_s - self.first_token_at_s) if self.first_token_at_s else 0.0
        return Answer(self.text if text is None else text, finish_reason, usage or Usage(), self.token_count,
                      decode_s)


# Why an answer ended, when the status line should say it (eos and stop strings are the
# usual ends and go unmentioned).
_FINISH_NOTES = {
    "length": "cut at --max-tokens",
    "context": "the context is full: /reset or /save and start over",
    "cancelled": "cancelled",
}


def status_line(answer: Answer) -> str:
    """'42 tokens, 38.1 tok/s, prompt 311 tokens (280 cached), first token 95 ms'."""
    if answer.finish_reason == "interrupted":
        line = f"stopped by Ctrl-C after {answer.token_count} tokens"
        if answer.token_count > 1 and answer.decode_s > 0:
            line += f", {(answer.token_count - 1) / answer.decode_s:.1f} tok/s"
        return line
    usage = answer.usage
    prompt = f"prompt {usage.prompt_tokens} tokens"
    if usage.cached_prompt_tokens:  # a daemon with prefix caching says what it reused
        prompt += f" ({usage.cached_prompt_tokens} cached)"
    parts = [f"{usage.generated_tokens} tokens", f"{usage.decode_tokens_per_s:.1f} tok/s", prompt,
             f"first token {usage.time_to_first_token_ms:.0f} ms"]
    if answer.finish_reason in _FINISH_NOTES:
        parts.append(_FINISH_NOTES[answer.finish_reason])
    return ", ".join(parts)


# --------------------------------------------------------------------------------------------
# Line editing and history
# --------------------------------------------------------------------------------------------


def history_path() -> Path | None:
    """$XDG_STATE_HOME/colibri/chat_history (the XDG base directory spec ignores a relative
    value), else ~/.local/state/colibri/chat_history; None without a home directory."""
    state = os.environ.get("XDG_STATE_HOME")
    if state and os.path.isabs(state):
        return Path(state).joinpath(*HISTORY_FILE)
    try:
        return Path.home().joinpath(".local", "state", *HISTORY_FILE)
    except RuntimeError:  # no $HOME and no password entry
        return None


def start_line_editing() -> Callable[[], None]:
    """readline for input(), with the history file read in; returns what saves it at the end.
    Without readline (a Python built without it) the chat works, with plain input."""
    try:
        import readline
    except ImportError:
        return lambda: None
    path = history_path()
    readline.set_history_length(HISTORY_LINES)  # write_history_file keeps only the newest
    if path is not None:
        try:
            readline.read_history_file(path)
        except FileNotFoundError:
            pass
        except OSError as error:
            _error(f"history not read from {path}: {error.strerror or error}")

    def save_history() -> None:
        if path is None:
            return
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            # What was typed may be private: the file is created for its owner only.
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
            readline.write_history_file(path)
        except OSError as error:
            _error(f"history not saved to {path}: {error.strerror or error}")

    return save_history


# --------------------------------------------------------------------------------------------
# The chat
# --------------------------------------------------------------------------------------------


class Chat:
    """One conversation with the daemon: its turns, the generation options, the connection."""

    def __init__(self, args: argparse.Namespace, interactive: bool):
        self.args = args
        self.interactive = interactive
        self.json = command.wants_json(args)
        self.conversation = Conversation(system=args.system)
        self.sampling = command.sampling_fields(args)  # the generation options given, for every ask
        self._connection: Connection | None = None

    # ---- the connection -----------------------------------------------------------------

    def connection(self) -> Connection:
        """The open connection, or a new one (after a Ctrl-C or a lost daemon)."""
        if self._connection is None:
            self._connection = command.connect(self.args)
        return self._connection

    def disconnect(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    # ---- lines ----------------------------------------------------------------------------

    def handle(self, line: str) -> bool:
        """Carry out one line: a command or a turn. False when the chat should end."""
        if not line.strip():
            return True
        if line.startswith("//"):
            self.turn(line[1:])
            return True
        if line.startswith("/"):
            name, _, argument = line[1:].partition(" ")
            command = _COMMANDS.get(name)
            if command is None:
                raise ChatLineError(f"unknown command /{name}: /help lists them "
                                    "(to send a line that begins with /, write //)")
            return command(self, argument.strip())
        self.turn(line)
        return True

    def say(self, text: str) -> None:
        """A command's confirmation: shown at the terminal, not in scripts."""
        if self.interactive:
            _note(text)

    # ---- turns ----------------------------------------------------------------------------

    def turn(self, question: str) -> None:
        """Send the conversation and the question, show the answer, keep both."""
        try:
            answer = self.ask(question)
        except ClientError as error:
            if not self.interactive:
                raise  # main reports it and picks the exit status
            self._report(error)
            self.say("(the question was not added to the conversation)")
            return
        if answer.text or answer.finish_reason != "interrupted":
            self.conversation.add_turn(question, answer.text)
        else:
            self.say("(stopped before the answer began: the question was not added to the conversation)")
        if not self.json:
            _note(status_line(answer), dim=True)

    def ask(self, question: str) -> Answer:
        connection = self.connection()
        fields = replace(self.conversation.ask_fields(question), **self.sampling)
        received = _Received()
        request_id = None
        try:
            request_id = connection.ask(fields)
            for event in connection.events(request_id):
                if isinstance(event, TokenEvent):
                    received.add(event)
                    self._show_token(event)
                elif isinstance(event, DoneEvent):
                    return self._show_done(event, received)
            raise ProtocolViolation("the daemon ended an ask without a done event")
        except KeyboardInterrupt:
            # Stop the generation. The rest of this request's events (and the cancel's ok) are
            # not waited for: the connection is closed instead, and the next turn opens a new
            # one. An interrupt can land between a read and its bookkeeping; a fresh
            # connection cannot be out of step.
            if request_id is not None:
                connection.cancel(request_id)
            self.disconnect()
            self._end_answer(received)
            if self.json:
                _write_json({"event": "cancelled", "id": request_id, "text": received.text,
                             "generated_tokens": received.token_count})
            if not self.interactive:
                raise
            return received.answer("interrupted")
        except BrokenPipeError:  # stdout's reader is gone (`| head`): nobody reads the rest
            if request_id is not None:
                connection.cancel(request_id)
            raise
        except ClientError as error:
            if not isinstance(error, RequestError) or error.request_id is None:
                self.disconnect()  # the daemon closed it, or it can no longer be trusted
            self._end_answer(received)
            if self.json and isinstance(error, RequestError):
                _write_json(ErrorEvent(error.request_id, error.code, error.message).to_wire())
            raise

    def _show_token(self, event: TokenEvent) -> None:
        if self.json:
            _write_json(event.to_wire())
        elif event.text:
            _write(event.text)

    def _show_done(self, done: DoneEvent, received: _Received) -> Answer:
        text = done.text
        if self.json:
            _write_json(done.to_wire())
        else:
            if text.startswith(received.text) and text != received.text:
                _write(text[len(received.text):])  # a tail no token event carried
            _write("" if text.endswith("\n") else "\n")  # empty answer: an empty line
        return received.answer(done.finish_reason, text, done.usage)

    def _end_answer(self, received: _Received) -> None:
        """End the line of an answer cut short, so what follows starts on its own line."""
        if self.json or not received.parts:
            return
        try:
            if not received.text.endswith("\n"):
                _write("\n")
        except OSError:  # a failure to write must not hide why the answer ended
            pass

    def _report(self, error: ClientError) -> None:
        if isinstance(error, DaemonUnreachable):
            command.report_unreachable(error)
        elif isinstance(error, RequestError):
            _error(f"error [{error.code}]: {error.message}")
            if error.code == "frame_too_large":
                _error("the conversation no longer fits in one request: /save it, then /reset")
        elif isinstance(error, ProtocolViolation):
            _error(f"protocol error: {error} (is that socket really colibrid's?)")
        else:
            _error(str(error))

    # ---- running ----------------------------------------------------------------------------

    def run_interactive(self) -> int:
        save_history = start_line_editing()
        hello = self.connection().hello
        _note(f"colibrictl chat with {hello.model} ({hello.server}): "
              "/help lists the commands, Ctrl-D leaves.", dim=True)
        try:
            while True:
                try:
                    line = input(PROMPT)
                except KeyboardInterrupt:  # at the prompt: the line is dropped, the chat goes on
                    _write("\n")
                    continue
                except EOFError:
                    _write("\n")
                    return command.EXIT_OK
                try:
                    if not self.handle(line):
                        return command.EXIT_OK
                except (ChatLineError, ConversationFileError) as error:
                    _error(str(error))
                except KeyboardInterrupt:  # between the steps of a turn: start clean
                    self.disconnect()
                    _write("\n")
        finally:
            save_history()
            self.disconnect()

    def run_script(self) -> int:
        self.connection()  # an unreachable daemon is reported before stdin is read
        try:
            for raw_line in iter(sys.stdin.buffer.readline, b""):  # a line as soon as it comes
                line = command.drop_final_newline(raw_line.decode("utf-8", errors="replace"))
                try:
                    if not self.handle(line):
                        break
                except (ChatLineError, ConversationFileError) as error:
                    _error(str(error))
                    return command.EXIT_USAGE
        finally:
            self.disconnect()
        return command.EXIT_OK


# --------------------------------------------------------------------------------------------
# Commands: each takes the chat and the rest of the line, and returns False to end the chat
# --------------------------------------------------------------------------------------------


def _help(chat: Chat, argument: str) -> bool:
    _note(f"{COMMANDS_HELP}\n{CTRL_C_HELP}")
    return True


def _exit(chat: Chat, argument: str) -> bool:
    return False


def _system(chat: Chat, argument: str) -> bool:
    chat.conversation.system = argument or None
    chat.say("system prompt set" if argument else "system prompt removed")
    return True


def _reset(chat: Chat, argument: str) -> bool:
    turn_count = len(chat.conversation.turns) // 2
    chat.conversation.turns.clear()
    chat.say(f"forgot {turn_count} turns (the system prompt stays)")
    return True


def _save(chat: Chat, argument: str) -> bool:
    if not argument:
        raise ChatLineError("/save needs a file name: /save FILE")
    conversation.save(chat.conversation, argument)
    chat.say(f"saved {len(chat.conversation.as_messages())} messages to {argument}")
    return True


def _load(chat: Chat, argument: str) -> bool:
    if not argument:
        raise ChatLineError("/load needs a file name: /load FILE")
    chat.conversation = conversation.load(argument)
    system = "with a system prompt" if chat.conversation.system is not None else "no system prompt"
    chat.say(f"loaded {len(chat.conversation.turns) // 2} turns from {argument} ({system})")
    return True


_COMMANDS: dict[str, Callable[[Chat, str], bool]] = {
    "system": _system, "reset": _reset, "save": _save, "load": _load,
    "help": _help, "exit": _exit, "quit": _exit,
}


def run_chat(args: argparse.Namespace) -> int:
    if sys.stdin is None:
        args.parser.error("no stdin to read the conversation from")
    chat = Chat(args, interactive=sys.stdin.isatty())
    return chat.run_interactive() if chat.interactive else chat.run_script()
