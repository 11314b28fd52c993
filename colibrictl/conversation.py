"""A chat's conversation: the system prompt and the turns, and the JSON file /save writes and
/load reads.

The file is a JSON list of ``{"role", "content"}`` messages (the shape OpenAI's and
Hugging Face's chat APIs take): the system message first if there is one, then user and
assistant turns in alternation, ending with an assistant turn. A file is anyone's to write,
so /load checks all of it and says exactly what is wrong, before the chat uses any of it.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field

from colibrid.wire.requests import AskFields

# A conversation file larger than this is refused before it is parsed. The daemon takes far
# less in one request (max_frame_bytes, 1 MiB by default); this only stops a wrong file (a
# disk image, /dev/zero) from filling the client's memory.
MAX_FILE_BYTES = 64 * 1024 * 1024

_TURN_ROLES = ("user", "assistant")  # the order turns alternate in


class ConversationFileError(Exception):
    """A conversation file that cannot be read, written, or used; the message says why."""


@dataclass
class Conversation:
    """The system prompt (None: none) and the turns, oldest first, as protocol messages."""

    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)

    def add_turn(self, question: str, answer: str) -> None:
        self.turns += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]

    def ask_fields(self, question: str) -> AskFields:
        """The ask that sends the whole conversation and the new question."""
        return AskFields(messages=[*self.turns, {"role": "user", "content": question}], system=self.system)

    def as_messages(self) -> list[dict[str, str]]:
        """Everything, the system prompt as the first message: what a file holds."""
        system = [] if self.system is None else [{"role": "system", "content": self.system}]
        return [*system, *self.turns]


def from_messages(messages: object) -> Conversation:
    """A Conversation from a file's parsed JSON; ConversationFileError naming the first fault."""
    if not isinstance(messages, list):
        raise ConversationFileError(
            f"it holds a JSON {_json_type(messages)}; a conversation is a list of "
            '{"role": ..., "content": ...} messages')
    for number, message in enumerate(messages, start=1):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise ConversationFileError(
                f'message {number} is not a map of exactly "role" and "content"')
        if not all(isinstance(value, str) for value in message.values()):
            raise ConversationFileError(f'message {number}: "role" and "content" must be strings')
    system = None
    if messages and messages[0]["role"] == "system":
        system, messages = messages[0]["content"], messages[1:]
    first_turn = 1 if system is None else 2  # the number of turns[0] in the file
    for index, message in enumerate(messages):
        expected, role = _TURN_ROLES[index % 2], message["role"]
        if role != expected:
            rule = ("a system message may only come first" if role == "system"
                    else "turns alternate user, assistant, starting with user")
            raise ConversationFileError(
                f"message {first_turn + index} has role {role!r} where {expected!r} was expected: {rule}")
    if len(messages) % 2:
        raise ConversationFileError(
            f"message {first_turn + len(messages) - 1}, the last, is a user message without an answer; "
            "a conversation ends with the assistant's turn")
    return Conversation(system, [dict(message) for message in messages])


def _json_type(value: object) -> str:
    names = {dict: "object", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def load(path: str) -> Conversation:
    """Read and check a conversation file (~ expanded)."""
    path = os.path.expanduser(path)
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_FILE_BYTES + 1)
    except OSError as error:
        raise ConversationFileError(f"cannot read {path}: {error.strerror or error}") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConversationFileError(f"{path} is larger than {MAX_FILE_BYTES // (1024 * 1024)} MiB; "
                                    "not a conversation file")
    try:
        messages = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ConversationFileError(f"{path} is not UTF-8 text (byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise ConversationFileError(f"{path} is not JSON: line {error.lineno} column {error.colno}: "
                                    f"{error.msg}") from None
    except RecursionError:  # [[[[...]]]] nested deeper than the parser goes
        raise ConversationFileError(f"{path} is nested too deeply to be a conversation") from None
    try:
        return from_messages(messages)
    except ConversationFileError as error:
        raise ConversationFileError(f"{path}: {error}") from None


def save(conversation: Conversation, path: str) -> None:
    """Write the conversation to path (~ expanded), replacing the file at once: a failed write
    leaves any earlier file as it was. The file is readable by its owner only (mode 0600), as
    a conversation may be private."""
    path = os.path.expanduser(path)
    text = json.dumps(conversation.as_messages(), ensure_ascii=False, indent=2) + "\n"
    directory = os.path.dirname(os.path.abspath(path))
    temporary = None
    try:
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=directory, prefix=".colibri-chat-",
                                         delete=False) as file:
            temporary = file.name
            file.write(text)
        os.replace(temporary, path)
    except OSError as error:
        if temporary is not None:
            try:
                os.unlink(temporary)
            except OSError:
                pass
        raise ConversationFileError(f"cannot write {path}: {error.strerror or error}") from None
