"""colibri-openai's settings: a TOML file (etc/colibri/colibri-openai.toml documents each key),
every key also a flag (`max_request_bytes` <-> `--max-request-bytes`); a flag overrides the file.
An unknown key or a bad value stops the gateway at start with one line naming it (exit 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from colibrid import __version__
from colibrid.gateway.model_output import FORMATS

DEFAULT_CONFIG_PATH = Path("/etc/colibri/colibri-openai.toml")
LOG_LEVELS = ("error", "warning", "info", "debug")


class ConfigError(Exception):
    """A setting the gateway cannot start with; str() is the one-line explanation."""


@dataclass(frozen=True)
class GatewayConfig:
    socket: str = "/run/colibri/colibrid.sock"  # colibrid's Unix socket
    listen: str = "127.0.0.1:8080"  # HOST:PORT to bind when systemd passes no socket
    api_keys_file: str = ""  # one bearer key per line; "" = no authentication
    max_request_bytes: int = 1024 * 1024  # largest HTTP request body
    tool_call_format: str = "auto"  # how tool calls are read from the model's text (model_output.FORMATS)
    retry_after_s: int = 1  # Retry-After of a 429 (colibrid busy) or 503 (thermal, unreachable)
    daemon_timeout_s: float = 10.0  # connecting to colibrid and its hello; status for /health and /metrics
    log_level: str = "info"


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _positive_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def parse_listen(value: str) -> tuple[str, int]:
    """HOST:PORT (HOST may be [IPv6]; port 0 lets the kernel choose, the log names it); ValueError if not."""
    host, separator, port = value.rpartition(":")
    if not separator or not port.isdigit() or not 0 <= int(port) < 65536 or not host:
        raise ValueError(f"listen must be HOST:PORT, e.g. 127.0.0.1:8080 or [::1]:8080, got {value!r}")
    return host.strip("[]"), int(port)


def _is_listen(value: Any) -> bool:
    try:
        parse_listen(value)
    except (ValueError, AttributeError):
        return False
    return isinstance(value, str)


# key -> (check, what is allowed, how a flag's text becomes a value)
KEYS = {
    "socket": (lambda v: isinstance(v, str) and 0 < len(v.encode()) <= 107, "a socket path of at most 107 bytes", str),
    "listen": (_is_listen, "HOST:PORT", str),
    "api_keys_file": (lambda v: isinstance(v, str), "a path, or \"\" for no authentication", str),
    "max_request_bytes": (_positive_int, "an integer >= 1", int),
    "tool_call_format": (lambda v: v in FORMATS, " or ".join(FORMATS), str),
    "retry_after_s": (_positive_int, "an integer >= 1", int),
    "daemon_timeout_s": (_positive_number, "a number > 0", float),
    "log_level": (lambda v: v in LOG_LEVELS, " or ".join(LOG_LEVELS), str),
}
assert set(KEYS) == {f.name for f in dataclasses.fields(GatewayConfig)}


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


def build_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="colibri-openai",
        description="An OpenAI-compatible HTTP gateway to colibrid (docs/gateway.md).")
    parser.add_argument("--config", type=Path, default=None,
                        help=f"TOML file of the keys below (default {DEFAULT_CONFIG_PATH} if it exists)")
    parser.add_argument("--version", action="version", version=f"colibri-openai {__version__}")
    for key, (_, allowed, _) in KEYS.items():
        default = getattr(GatewayConfig(), key)
        parser.add_argument(flag_name(key), dest=key, default=None, metavar="VALUE",
                            help=f"{allowed} (default {default!r})")
    return parser


def load_config(argv: Sequence[str] | None = None) -> GatewayConfig:
    args = build_arg_parser().parse_args(argv)
    values: dict[str, Any] = {}
    path = args.config or (DEFAULT_CONFIG_PATH if DEFAULT_CONFIG_PATH.exists() else None)
    if path is not None:
        try:
            values = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read {path}: {exc}") from None
        unknown = sorted(set(values) - set(KEYS))
        if unknown:
            raise ConfigError(f"{path}: unknown key {unknown[0]!r}; the keys are {', '.join(KEYS)}")
    for key, (_, _, from_text) in KEYS.items():
        text = getattr(args, key)
        if text is not None:
            try:
                values[key] = from_text(text)
            except ValueError:
                raise ConfigError(f"{flag_name(key)} {text!r}: must be {KEYS[key][1]}") from None
    for key, value in values.items():
        check, allowed, _ = KEYS[key]
        if key == "daemon_timeout_s" and isinstance(value, int) and not isinstance(value, bool):
            value = values[key] = float(value)
        if not check(value):
            raise ConfigError(f"{key} = {value!r}: must be {allowed}")
    return GatewayConfig(**values)
