"""The daemon's settings: one dataclass, read from a TOML file, every key overridable by a flag.

    model = "/var/lib/colibri/olmoe.pack"      <->  --model /var/lib/colibri/olmoe.pack
    max_queue = 16                             <->  --max-queue 16

Flags override the file; the file overrides the defaults. Every key is checked once, at start,
and the first bad one stops the daemon with one line that names the key, the value and what is
allowed - a daemon that starts with a setting it cannot honour would degrade silently later.
Unknown keys in the file are errors too: a misspelt key must not quietly mean "use the default".

etc/colibri/colibrid.toml documents every key for users; KEYS below is the same list for code.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_CONFIG_PATH = Path("/etc/colibri/colibrid.toml")
LOG_LEVELS = ("error", "warning", "info", "debug")
# sockaddr_un.sun_path is 108 bytes on Linux, one of them the terminating NUL.
MAX_SOCKET_PATH_BYTES = 107
# A frame must hold a hello and a short ask; above 64 MiB one client could pin too much memory.
MIN_FRAME_BYTES = 1024
MAX_FRAME_BYTES = 64 * 1024 * 1024


class ConfigError(Exception):
    """A setting the daemon cannot start with; str() is the whole one-line explanation."""


@dataclass(frozen=True)
class DaemonConfig:
    model: Path  # the pack directory to serve
    socket: Path = Path("/run/colibri/colibrid.sock")
    max_queue: int = 16  # requests waiting beyond the one running
    max_frame_bytes: int = 1024 * 1024  # largest frame accepted or sent, length prefix excluded
    max_context: int = 4096  # tokens one request may hold: prompt + generated
    default_max_tokens: int = 256  # for an ask without max_tokens
    log_level: str = "info"


@dataclass(frozen=True)
class _Key:
    """How one key is parsed from a flag and checked; `allowed` is said in the error message."""

    name: str
    meaning: str  # for --help
    allowed: str
    parse_flag: Callable[[str], Any]
    is_valid: Callable[[Any], bool]
    flag_metavar: str


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_at_least(minimum: int, maximum: int | None = None) -> Callable[[Any], bool]:
    return lambda v: _is_int(v) and v >= minimum and (maximum is None or v <= maximum)


def _is_pack_dir(value: Any) -> bool:
    return isinstance(value, str) and value != "" and Path(value).is_dir()


def _is_socket_path(value: Any) -> bool:
    return isinstance(value, str) and value != "" and len(os.fsencode(value)) <= MAX_SOCKET_PATH_BYTES


def _parse_int_flag(text: str) -> int | str:
    try:
        return int(text)
    except ValueError:
        return text  # left as a string, so the check fails and the message shows what was given


KEYS: tuple[_Key, ...] = (
    _Key("model", "the pack directory to serve", "must be the path of a pack directory (colibri-convert or python -m colibrid.demo writes one)",
         str, _is_pack_dir, "PATH"),
    _Key("socket", "the Unix socket clients connect to", f"must be a non-empty path of at most {MAX_SOCKET_PATH_BYTES} bytes",
         str, _is_socket_path, "PATH"),
    _Key("max_queue", "requests that may wait while one runs", "must be an integer >= 1", _parse_int_flag, _int_at_least(1), "N"),
    _Key("max_frame_bytes", "largest request frame accepted, in bytes", f"must be an integer in [{MIN_FRAME_BYTES}, {MAX_FRAME_BYTES}]",
         _parse_int_flag, _int_at_least(MIN_FRAME_BYTES, MAX_FRAME_BYTES), "BYTES"),
    _Key("max_context", "tokens one request may hold, prompt plus output", "must be an integer >= 2 (tokens)", _parse_int_flag, _int_at_least(2), "TOKENS"),
    _Key("default_max_tokens", "tokens generated when an ask sets no max_tokens", "must be an integer >= 1", _parse_int_flag, _int_at_least(1), "N"),
    _Key("log_level", "how much to log to stderr", f"must be one of {', '.join(LOG_LEVELS)}", str, lambda v: v in LOG_LEVELS, "LEVEL"),
)
assert [k.name for k in KEYS] == [f.name for f in dataclasses.fields(DaemonConfig)], "KEYS and DaemonConfig differ"


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def _render(value: Any) -> str:
    """A value as it would be written in TOML, so the message can be pasted back into the file."""
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="colibrid",
        description="Serve a Mixture-of-Experts model over a Unix socket (protocol: docs/protocol.md).",
        epilog=f"Every flag overrides the key of the same name in the config file (default {DEFAULT_CONFIG_PATH}, "
               "documented key by key in the shipped copy).",
    )
    parser.add_argument("--config", metavar="PATH", default=None,
                        help=f"TOML config file (default {DEFAULT_CONFIG_PATH}, if it exists)")
    defaults = {f.name: f.default for f in dataclasses.fields(DaemonConfig)}
    for key in KEYS:
        default = defaults[key.name]
        shown_default = ", required" if default is dataclasses.MISSING else f", default {default}"
        parser.add_argument(flag_name(key.name), dest=key.name, metavar=key.flag_metavar, default=None,
                            help=f"{key.meaning} (key {key.name}{shown_default})")
    return parser


def read_config_file(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    known = {key.name for key in KEYS}
    for name in table:
        if name not in known:
            raise ConfigError(f"unknown key {name!r} in {path}; known keys: {', '.join(k.name for k in KEYS)}")
    return table


def load_config(argv: Sequence[str] | None = None) -> DaemonConfig:
    """Defaults, then the file, then the flags; raise ConfigError for the first bad key."""
    args = build_arg_parser().parse_args(argv)
    config_path = Path(args.config) if args.config is not None else DEFAULT_CONFIG_PATH
    from_file: dict[str, Any] = {}
    if args.config is not None or config_path.exists():
        from_file = read_config_file(config_path)

    values: dict[str, Any] = {}
    for key in KEYS:
        flag_value = getattr(args, key.name)
        if flag_value is not None:
            value, source = key.parse_flag(flag_value), flag_name(key.name)
        elif key.name in from_file:
            value, source = from_file[key.name], str(config_path)
        else:
            continue
        if not key.is_valid(value):
            raise ConfigError(f"{key.name} = {_render(value)}: {key.allowed} (from {source})")
        values[key.name] = value

    if "model" not in values:
        raise ConfigError(f"model is not set: pass --model PATH or set model in {config_path}")
    for path_key in ("model", "socket"):
        if path_key in values:
            values[path_key] = Path(values[path_key])
    return DaemonConfig(**values)
