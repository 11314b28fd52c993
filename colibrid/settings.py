"""How colibrid and colibri-openai read their settings: one key table, a TOML file, a flag per key.

A program's settings are a frozen dataclass whose every field is declared with `setting()`: its
type and default, the check its value must pass, whether a reload may change it, and its one
description. A ProgramSettings names that dataclass, and everything else follows from the table:

    the flags         every key is a flag of the same name in kebab case (flag_name, the one
                      rule: max_queue <-> --max-queue); --help shows each key's summary
    loading           the defaults, then the TOML file, then the flags; the first bad key stops
                      the start with one ConfigError naming the key, the value, where it came
                      from and what is allowed - a program that started with a setting it cannot
                      honour would degrade silently later. An unknown key in the file is an
                      error too: a misspelt key must not quietly mean "use the default".
    the shipped file  etc/colibri/*.toml documents every key: ProgramSettings.documented_toml()
                      writes it from the table, and a test fails when the file differs.

A description is written like a docstring: its first paragraph is the summary (the flag's help),
the paragraphs after it the detail the shipped file adds. What values a key takes and whether a
reload changes it are not written in the description: the shipped file says them from the check
and the `reloadable` mark, so they cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import textwrap
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from colibrid import __version__

LOG_LEVELS = ("error", "warning", "info", "debug")
# sockaddr_un.sun_path is 108 bytes on Linux, one of them the terminating NUL.
MAX_SOCKET_PATH_BYTES = 107
# The shipped file's comment lines, "# " included.
COMMENT_WIDTH = 95

Config = TypeVar("Config")  # a program's settings dataclass


class ConfigError(Exception):
    """A setting a program cannot start with. str() is the whole one-line explanation, and says
    how to fix it (what is allowed, or which keys there are); ``key`` is the key at fault and
    ``source`` where its value came from (the config file's path, or the flag), when known."""

    def __init__(self, message: str, *, key: str | None = None, source: str | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.source = source


def flag_name(key: str) -> str:
    """The flag of a key: its name in kebab case (max_queue -> --max-queue)."""
    return "--" + key.replace("_", "-")


def toml_value(value: Any) -> str:
    """A value as it is written in TOML, so that a message can be pasted back into the file."""
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, Path):
        return toml_value(str(value))
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)


# --------------------------------------------------------------------------------------------
# Checks: what values a key takes
# --------------------------------------------------------------------------------------------


def _unchanged(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Check:
    """What values a key takes.

    ``allowed`` completes the error message "key = value: <allowed>" (and, capitalised, the
    shipped file's line for the key). ``from_flag`` turns a flag's text into a value; text it
    cannot read is returned as it is, so that the check fails on it and the message shows what
    was given. ``normalise`` turns a valid value into the one the config holds (an int read for
    a float key into a float, a path string into a Path).
    """

    allowed: str
    is_valid: Callable[[Any], bool]
    from_flag: Callable[[str], Any] = str
    normalise: Callable[[Any], Any] = _unchanged


def is_int(value: Any) -> bool:
    """An integer, and not a bool (which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def int_from_flag(text: str) -> int | str:
    try:
        return int(text)
    except ValueError:
        return text


def float_from_flag(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def integer(minimum: int, maximum: int | None = None, unit: str = "") -> Check:
    """An integer >= minimum (and <= maximum, if given); ``unit`` is said in the message."""
    allowed = f"must be an integer >= {minimum}" if maximum is None else f"must be an integer in [{minimum}, {maximum}]"
    return Check(allowed + (f" ({unit})" if unit else ""),
                 lambda v: is_int(v) and v >= minimum and (maximum is None or v <= maximum), int_from_flag)


def number(minimum: float, *, above: bool = False, unit: str = "") -> Check:
    """A number >= minimum, or > minimum when ``above``; held as a float."""
    allowed = f"must be a number {'>' if above else '>='} {minimum:g}" + (f" ({unit})" if unit else "")
    return Check(allowed, lambda v: is_number(v) and (v > minimum if above else v >= minimum), float_from_flag, float)


def one_of(*choices: str) -> Check:
    """One of a few words: 'must be "a", "b" or "c"'."""
    quoted = [toml_value(choice) for choice in choices]
    allowed = "must be " + (", ".join(quoted[:-1]) + " or " + quoted[-1] if len(quoted) > 1 else quoted[0])
    return Check(allowed, lambda v: v in choices)


BOOLEAN = Check("must be true or false", lambda v: isinstance(v, bool), lambda text: {"true": True, "false": False}.get(text, text))
LOG_LEVEL = Check(f"must be one of {', '.join(LOG_LEVELS)}", lambda v: v in LOG_LEVELS)
SOCKET_PATH = Check(f"must be a non-empty path of at most {MAX_SOCKET_PATH_BYTES} bytes",
                    lambda v: isinstance(v, str) and v != "" and len(os.fsencode(v)) <= MAX_SOCKET_PATH_BYTES)


# --------------------------------------------------------------------------------------------
# Keys: one field of a settings dataclass each
# --------------------------------------------------------------------------------------------


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()  # the default of a key that must be set
_KEY_METADATA = "colibrid.settings.key"


@dataclass(frozen=True)
class Key:
    """One setting: its name is the dataclass field's, its flag flag_name(name).

    ``doc`` is its only description (first paragraph the summary); ``heading`` opens a group
    of keys in the shipped file (first paragraph its title); ``example`` is the value the
    shipped file sets a required key to.
    """

    name: str
    default: Any  # REQUIRED if it has none
    check: Check
    metavar: str  # what the flag takes, in --help: N, PATH, SECONDS
    doc: str
    reloadable: bool = False  # a reload (SIGHUP) applies it without a restart
    heading: str = ""
    example: Any = None

    @property
    def flag(self) -> str:
        return flag_name(self.name)

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    @property
    def summary(self) -> str:
        return paragraphs(self.doc)[0]


def setting(default: Any, check: Check, metavar: str, *, doc: str, reloadable: bool = False, heading: str = "",
            example: Any = None) -> Any:
    """A field of a settings dataclass that is a key: ``default`` (REQUIRED for none) and the
    rest as Key says. The default must be immutable (a tuple, not a list): the config is frozen."""
    described = {"check": check, "metavar": metavar, "doc": doc, "reloadable": reloadable, "heading": heading,
                 "example": example}
    if default is REQUIRED:
        return dataclasses.field(metadata={_KEY_METADATA: described})
    return dataclasses.field(default=default, metadata={_KEY_METADATA: described})


def keys_of(config_type: type) -> tuple[Key, ...]:
    """The keys of a settings dataclass, in the order of its fields."""
    keys = []
    for field in dataclasses.fields(config_type):
        if _KEY_METADATA not in field.metadata:
            raise TypeError(f"{config_type.__name__}.{field.name} is not declared with setting()")
        default = REQUIRED if field.default is dataclasses.MISSING else field.default
        keys.append(Key(field.name, default, **field.metadata[_KEY_METADATA]))
    return tuple(keys)


def paragraphs(text: str) -> list[str]:
    """The paragraphs of a description (separated by blank lines), each on one line."""
    return [" ".join(block.split()) for block in re.split(r"\n\s*\n", text.strip())]


# --------------------------------------------------------------------------------------------
# A program's settings: flags, loading, the shipped file
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProgramSettings(Generic[Config]):
    """The settings of one program: its key table and where they are read from."""

    program: str  # as --version and the messages name it
    config_type: type[Config]  # the frozen dataclass of its keys, each declared with setting()
    default_path: Path  # read if it exists and --config names no other file
    description: str  # --help's first line
    file_header: str  # the shipped file's opening comment, paragraphs as in a description
    reloads: bool = False  # it reads the file again on SIGHUP: the shipped file says which keys that changes
    check_together: Callable[[dict[str, Any]], None] | None = None  # checks across keys; raises ConfigError

    @property
    def keys(self) -> tuple[Key, ...]:
        return keys_of(self.config_type)

    def arg_parser(self) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(
            prog=self.program, description=self.description,
            epilog=f"Every flag overrides the key of the same name in the config file (default {self.default_path}, "
                   "documented key by key in the shipped copy).")
        parser.add_argument("--config", metavar="PATH", default=None,
                            help=f"TOML config file (default {self.default_path}, if it exists)")
        parser.add_argument("--version", action="version", version=f"{self.program} {__version__}")
        for key in self.keys:
            shown_default = ", required" if key.required else f", default {toml_value(key.default)}"
            # argparse %-formats help strings: a literal % ("40%" of MemAvailable) must be doubled.
            help_text = f"{key.summary} (key {key.name}{shown_default})".replace("%", "%%")
            parser.add_argument(key.flag, dest=key.name, metavar=key.metavar, default=None, help=help_text)
        return parser

    def read_file(self, path: Path) -> dict[str, Any]:
        """The keys a TOML file sets, as written; ConfigError if it cannot be read or names an unknown key."""
        try:
            with open(path, "rb") as f:
                table = tomllib.load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}", source=str(path)) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path} is not valid TOML: {exc}", source=str(path)) from None
        names = [key.name for key in self.keys]
        for name in table:
            if name not in names:
                raise ConfigError(f"unknown key {name!r} in {path}; known keys: {', '.join(names)}",
                                  key=name, source=str(path))
        return table

    def load(self, argv: Sequence[str] | None = None) -> Config:
        """The config: defaults, then the file, then the flags; ConfigError for the first bad key."""
        args = self.arg_parser().parse_args(argv)
        path = Path(args.config) if args.config is not None else self.default_path
        from_file = self.read_file(path) if args.config is not None or path.exists() else {}
        values: dict[str, Any] = {}
        for key in self.keys:
            flag_text = getattr(args, key.name)
            if flag_text is not None:
                value, source = key.check.from_flag(flag_text), key.flag
            elif key.name in from_file:
                value, source = from_file[key.name], str(path)
            else:
                continue
            if not key.check.is_valid(value):
                raise ConfigError(f"{key.name} = {toml_value(value)}: {key.check.allowed} (from {source})",
                                  key=key.name, source=source)
            values[key.name] = key.check.normalise(value)
        for key in self.keys:
            if key.required and key.name not in values:
                raise ConfigError(f"{key.name} is not set: pass {key.flag} {key.metavar} or set {key.name} in {path}",
                                  key=key.name)
        if self.check_together is not None:
            self.check_together(values)
        return self.config_type(**values)

    def documented_toml(self) -> str:
        """The shipped file: the header, then every key's description, what it takes, and its
        default (commented out) or, for a required key, its example value."""
        lines = _comment(paragraphs(self.file_header))
        for key in self.keys:
            if key.heading:
                title, *text = paragraphs(key.heading)
                lines += ["", f"# ---- {title} ----", *_comment(text)]
            lines += ["", *_comment(paragraphs(key.doc)), *_wrap(self._what_it_takes(key))]
            if key.required:
                lines.append(f"{key.name} = {toml_value(key.example)}")
            else:
                lines.append(f"#{key.name} = {toml_value(key.default)}")
        return "\n".join(lines) + "\n"

    def _what_it_takes(self, key: Key) -> str:
        said = key.check.allowed[0].upper() + key.check.allowed[1:] + "."
        if key.required:
            said += " Required; no default."
        if self.reloads:
            said += " Reloadable." if key.reloadable else " Takes effect at the next restart."
        return said


def _wrap(paragraph: str) -> list[str]:
    return textwrap.wrap(paragraph, COMMENT_WIDTH, initial_indent="# ", subsequent_indent="# ",
                         break_long_words=False, break_on_hyphens=False)


def _comment(texts: list[str]) -> list[str]:
    """Paragraphs as comment lines, an empty comment line between two."""
    lines: list[str] = []
    for text in texts:
        if lines:
            lines.append("#")
        lines += _wrap(text)
    return lines
