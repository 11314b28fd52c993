"""colibri-openai's settings: GatewayConfig, one field per key, read by colibrid.settings.

Every key is also a flag (`max_request_bytes` <-> `--max-request-bytes`); a flag overrides the
file. An unknown key or a bad value stops the gateway at start with one line naming it (exit 2).
Each field below is its key's only description: etc/colibri/colibri-openai.toml is written from
this table (`python -m colibrid.gateway.config > etc/colibri/colibri-openai.toml`;
tests/gateway/test_config.py fails when the two differ).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colibrid.gateway.model_output import FORMATS
from colibrid.settings import LOG_LEVEL, SOCKET_PATH, Check, ConfigError, ProgramSettings, integer, number, one_of, setting

# ConfigError is the gateway's one start-up error: main.py and app.py raise it too.
__all__ = ["ConfigError", "GATEWAY_SETTINGS", "GatewayConfig", "load_config", "parse_listen"]

DEFAULT_CONFIG_PATH = Path("/etc/colibri/colibri-openai.toml")


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


LISTEN = Check("must be HOST:PORT, e.g. 127.0.0.1:8080 or [::1]:8080", _is_listen)
API_KEYS_FILE = Check('must be a path, or "" for no authentication', lambda v: isinstance(v, str))


@dataclass(frozen=True)
class GatewayConfig:
    socket: str = setting("/run/colibri/colibrid.sock", SOCKET_PATH, "PATH", doc="""
        colibrid's Unix socket.

        The gateway connects once per request (and per health check).""")
    listen: str = setting("127.0.0.1:8080", LISTEN, "HOST:PORT", doc="""
        HOST:PORT to listen on when systemd passes no socket.

        colibri-openai.socket passes one, and this key is then not used. [::1]:8080 for IPv6;
        port 0 lets the kernel choose (logged).""")
    api_keys_file: str = setting("", API_KEYS_FILE, "PATH", doc="""
        A file of API keys, one per line; "" (the default): no authentication.

        Blank lines and lines starting with # are skipped. Requests to /v1/... must then carry
        `Authorization: Bearer KEY`; /health and /metrics stay open for load balancers and
        Prometheus. A file that cannot be read, or holds no key, stops the gateway at start.""")
    max_request_bytes: int = setting(1024 * 1024, integer(1), "BYTES", doc="""
        The largest HTTP request body, in bytes; a larger one is answered 413.

        colibrid refuses frames above its max_frame_bytes (1 MiB by default), so a larger value
        buys nothing.""")
    tool_call_format: str = setting("auto", one_of(*FORMATS), "FORMAT", doc="""
        How tool calls are read out of the model's text.

        "auto": Harmony for gpt-oss; for other families any of the Hermes/GLM <tool_call>,
        DeepSeek and Kimi K2 conventions, by their markers. "hermes", "harmony", "deepseek" or
        "kimi": that convention only. "none": never parse.""")
    retry_after_s: int = setting(1, integer(1, unit="seconds"), "SECONDS", doc="""
        Retry-After, in seconds, sent with a 429 or a 503.

        A 429 when colibrid's queue is full; a 503 when colibrid is unreachable, or its drive too
        hot.""")
    daemon_timeout_s: float = setting(10.0, number(0, above=True, unit="seconds"), "SECONDS", doc="""
        Seconds that connecting to colibrid and its hello, and a status for /health or /metrics,
        may take.""")
    log_level: str = setting("info", LOG_LEVEL, "LEVEL", doc="""
        How much colibri-openai logs to stderr (the journal under systemd).""")


GATEWAY_SETTINGS = ProgramSettings(
    program="colibri-openai",
    config_type=GatewayConfig,
    default_path=DEFAULT_CONFIG_PATH,
    description="An OpenAI-compatible HTTP gateway to colibrid (docs/gateway.md).",
    file_header="""
        colibri-openai configuration (docs/gateway.md). Installed as
        /etc/colibri/colibri-openai.toml; read at start. Every key is also a flag of the same name
        in kebab case (max_request_bytes <-> --max-request-bytes); a flag overrides the file. Keys
        shown commented out are at their default. An unknown key or a bad value stops the gateway
        at start (exit 2).

        These descriptions are written from colibrid/gateway/config.py, the gateway's one table of
        keys (python -m colibrid.gateway.config).""",
)


def load_config(argv: Sequence[str] | None = None) -> GatewayConfig:
    """The defaults, then the file, then the flags; ConfigError for the first bad key."""
    return GATEWAY_SETTINGS.load(argv)


if __name__ == "__main__":  # python -m colibrid.gateway.config > etc/colibri/colibri-openai.toml
    print(GATEWAY_SETTINGS.documented_toml(), end="")
