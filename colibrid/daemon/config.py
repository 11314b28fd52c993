"""The daemon's settings: one dataclass, read from a TOML file, every key overridable by a flag.

    model = "/var/lib/colibri/olmoe.pack"      <->  --model /var/lib/colibri/olmoe.pack
    max_queue = 16                             <->  --max-queue 16

Flags override the file; the file overrides the defaults. Every key is checked once, at start,
and the first bad one stops the daemon with one line that names the key, the value and what is
allowed - a daemon that starts with a setting it cannot honour would degrade silently later.
Unknown keys in the file are errors too: a misspelt key must not quietly mean "use the default".

etc/colibri/colibrid.toml documents every key for users; KEYS below is the same list for code.
A key marked `reloadable` takes effect on SIGHUP (`systemctl reload colibrid`); the others only
at the next start, because they are bound into something built once (the loaded model, the
listening socket). To add a key: a field in DaemonConfig, an entry in KEYS at the same place,
its documentation in the shipped file, and - if reloadable - its use in Daemon.apply_reload.
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

from colibrid import __version__

DEFAULT_CONFIG_PATH = Path("/etc/colibri/colibrid.toml")
LOG_LEVELS = ("error", "warning", "info", "debug")
# sockaddr_un.sun_path is 108 bytes on Linux, one of them the terminating NUL.
MAX_SOCKET_PATH_BYTES = 107
# A frame must hold a hello and a short ask; above 64 MiB one client could pin too much memory.
MIN_FRAME_BYTES = 1024
MAX_FRAME_BYTES = 64 * 1024 * 1024
# Each connection costs a file descriptor and up to max_outbox_bytes of memory.
MAX_CONNECTIONS = 65536
MIN_OUTBOX_BYTES = 64 * 1024
MAX_OUTBOX_BYTES = 256 * 1024 * 1024
# Thermal thresholds a drive can meaningfully have, and the shortest poll: every poll makes the
# drive answer SMART commands, so it must stay a matter of seconds, never a tight loop.
MIN_THERMAL_C, MAX_THERMAL_C = 20.0, 120.0
MIN_THERMAL_POLL_S = 1.0


class ConfigError(Exception):
    """A setting the daemon cannot start with; str() is the whole one-line explanation."""


@dataclass(frozen=True)
class DaemonConfig:
    model: Path  # the pack directory to serve
    socket: Path = Path("/run/colibri/colibrid.sock")
    socket_group: str = "colibri"  # group of a socket we bind ourselves, if that group exists; "" leaves it
    allow_users: tuple[str | int, ...] = ()  # peers allowed by user (name or uid); () with allow_groups () = anyone
    allow_groups: tuple[str | int, ...] = ()  # peers allowed by any of their groups (name or gid)
    max_queue: int = 16  # requests waiting beyond the running batch
    max_batch: int = 8  # requests decoding together in one batch (each step advances them all)
    prefill_chunk: int = 512  # prompt tokens per step, in all: a long prompt runs in chunks beside the others' tokens
    kv_cache_size: str = "10%"  # the running requests' KV caches together: bytes, "2G", or "10%" of the memory budget
    kv_cache_type: str = "f32"  # attention keys and values as "f32" (exact) or "f16" (half the memory and reads)
    prefix_cache_size: str = "5%"  # finished requests' states kept for prefix reuse: bytes, "1G", "5%"; 0: off
    max_frame_bytes: int = 1024 * 1024  # largest frame accepted or sent, length prefix excluded
    max_connections: int = 128  # clients connected at once; one more gets `busy` and is closed
    max_outbox_bytes: int = 1024 * 1024  # replies queued for one client before its requests wait
    stalled_client_timeout_s: float = 30.0  # how long a client may leave max_outbox_bytes unread
    hello_timeout_s: float = 10.0  # from connecting to a complete hello
    frame_timeout_s: float = 30.0  # from a frame's first byte to its last
    max_context: int = 4096  # tokens one request may hold: prompt + generated
    default_max_tokens: int = 256  # for an ask without max_tokens
    parse_special_tokens_in_content: bool = False  # True: "<|im_start|>" in a chat message becomes the special token
    cache_size: str = "50%"  # the expert cache (AEPC): bytes, "6G", or "40%" of the memory budget at start
    cache_policy: str = "next-use"  # eviction: "next-use", "lfu-decay" (decayed frequency), "lfru" or "lru"
    io_queue_depth: int = 16  # expert reads in flight at most
    prefetch: str = "lookahead"  # "lookahead": predict the next layer's experts and read them early; "off"
    lookahead_predictor: str = "router-on-moe-input"  # what lookahead guesses from; or "router-on-residual"
    hugepages: str | int = "auto"  # "auto", "thp", "off", or a count of 2 MiB pages to reserve
    lock_memory: str = "try"  # mlock the cache: "required", "try" or "off"
    hugepage_record: Path = Path("/run/colibri/hugepages.json")  # hugepages raised and not yet given back
    thermal: str = "auto"  # "auto": watch the NVMe drive(s) under the experts file and throttle; "off"
    thermal_poll_s: float = 5.0  # seconds between temperature reads (each one is a command to the drive)
    thermal_throttle: float | str = "auto"  # °C; "auto": the drive's warning threshold - 5, else 65
    thermal_resume: float | str = "auto"  # °C; "auto": thermal_throttle - 5
    shutdown_grace_s: float = 30.0  # how long accepted requests may still run after SIGTERM
    stall_timeout_s: float = 120.0  # longest wait for a request's next token before the health check fails
    cpu_affinity: str = "auto"  # CPUs of the engine (compute) thread: "auto" or a list like "0-3,8"
    io_cpus: str = "auto"  # CPUs of the server (event loop) and I/O threads
    nice: int = 0  # scheduling niceness to set at start; 0 leaves it as inherited
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
    reloadable: bool = False  # applied on SIGHUP without a restart
    normalise: Callable[[Any], Any] = lambda value: value  # a checked value -> the DaemonConfig value


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


def _parse_bool_flag(text: str) -> bool | str:
    return {"true": True, "false": False}.get(text, text)


def _parse_float_flag(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def _number_at_least(minimum: float) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= minimum


def _positive_number(value: Any) -> bool:
    return _number_at_least(0)(value) and value > 0


def _is_size(value: Any, minimum: int = 1) -> bool:
    from colibrid.system.memory import parse_size

    if not isinstance(value, (str, int)) or isinstance(value, bool):
        return False
    try:
        return parse_size(value, "cache_size") >= minimum
    except (ValueError, OSError):
        return False


def _is_size_or_zero(value: Any) -> bool:
    return _is_size(value, minimum=0)


def _parse_hugepages_flag(text: str) -> int | str:
    return int(text) if text.isdigit() else text


def _is_hugepages(value: Any) -> bool:
    return value in ("auto", "thp", "off") or (_is_int(value) and value >= 0)


def _parse_principals_flag(text: str) -> list[str | int]:
    """--allow-users alice,1001 -> ["alice", 1001]: numbers are ids, anything else a name."""
    return [int(item) if item.strip().isdigit() else item.strip() for item in text.split(",") if item.strip()]


def _parse_celsius_flag(text: str) -> float | str:
    return text if text == "auto" else _parse_float_flag(text)


def _is_celsius_setting(value: Any) -> bool:
    """"auto" or a temperature a drive can have, in °C."""
    return value == "auto" or (_number_at_least(MIN_THERMAL_C)(value) and value <= MAX_THERMAL_C)


def _celsius(value: Any) -> float | str:
    return value if value == "auto" else float(value)


def _is_principal_list(value: Any) -> bool:
    return isinstance(value, list) and all((isinstance(v, str) and v != "") or (_is_int(v) and v >= 0) for v in value)


def _is_cpu_setting(value: Any) -> bool:
    # Imported here: affinity reads the machine's topology, which config parsing never needs otherwise.
    from colibrid.system.affinity import CpuListError, check_cpu_setting

    if not isinstance(value, str):
        return False
    try:
        check_cpu_setting(value)
    except CpuListError:
        return False
    return True


KEYS: tuple[_Key, ...] = (
    _Key("model", "the pack directory to serve", "must be the path of a pack directory (colibri-convert or python -m colibrid.tools.demo writes one)",
         str, _is_pack_dir, "PATH"),
    _Key("socket", "the Unix socket clients connect to (unless systemd passes one)",
         f"must be a non-empty path of at most {MAX_SOCKET_PATH_BYTES} bytes", str, _is_socket_path, "PATH"),
    _Key("socket_group", "group given to a socket colibrid binds itself, if that group exists",
         'must be a group name, or "" to leave the group as created', str, lambda v: isinstance(v, str), "GROUP"),
    _Key("allow_users", "users allowed to connect, comma-separated names or uids (empty: anyone who can open the socket)",
         "must be a list of user names or uids", _parse_principals_flag, _is_principal_list, "USERS",
         reloadable=True, normalise=tuple),
    _Key("allow_groups", "groups whose members may connect, comma-separated names or gids",
         "must be a list of group names or gids", _parse_principals_flag, _is_principal_list, "GROUPS",
         reloadable=True, normalise=tuple),
    _Key("max_queue", "requests that may wait while the batch runs", "must be an integer >= 1", _parse_int_flag,
         _int_at_least(1), "N", reloadable=True),
    _Key("max_batch", "requests decoding together: each step advances all of them and reads each expert once for all",
         "must be an integer in [1, 256]", _parse_int_flag, _int_at_least(1, 256), "N"),
    _Key("prefill_chunk", "prompt tokens per step in all: a long prompt is fed in chunks of this size between the "
         "other requests' tokens (twice that in a step where none is generating yet)",
         "must be an integer in [1, 512]", _parse_int_flag, _int_at_least(1, 512), "TOKENS"),
    _Key("kv_cache_size", 'memory for the running requests\' KV caches together: bytes, "2G", "512M" or "10%" of the '
         'memory budget; a request is admitted when its prompt plus max_tokens fits',
         'must be a size above 0: bytes (123), K/M/G/T ("512M", "2G") or a percentage of the memory budget ("10%")',
         _parse_int_flag, _is_size, "SIZE"),
    _Key("kv_cache_type", 'what attention layers store their keys and values as: f32 (the model\'s numbers '
         'exactly) or f16 (half the KV memory and reads, each key and value rounded to float16 as it is stored)',
         'must be "f32" or "f16"', str, lambda v: v in ("f32", "f16"), "TYPE"),
    _Key("prefix_cache_size", 'memory for finished requests\' states kept so that a request beginning with the same '
         'tokens (the next turn of a chat) prefills only the rest: bytes, "1G", "512M" or "5%" of the memory budget; '
         '0 turns prefix reuse off',
         'must be a size: bytes (123, or 0 for off), K/M/G/T ("512M", "1G") or a percentage of the memory budget ("5%")',
         _parse_int_flag, _is_size_or_zero, "SIZE"),
    _Key("max_frame_bytes", "largest request frame accepted, in bytes", f"must be an integer in [{MIN_FRAME_BYTES}, {MAX_FRAME_BYTES}]",
         _parse_int_flag, _int_at_least(MIN_FRAME_BYTES, MAX_FRAME_BYTES), "BYTES", reloadable=True),
    _Key("max_connections", "clients connected at once; one more gets a busy error and is closed",
         f"must be an integer in [1, {MAX_CONNECTIONS}]", _parse_int_flag, _int_at_least(1, MAX_CONNECTIONS), "N",
         reloadable=True),
    _Key("max_outbox_bytes", "bytes of replies queued for one client before its next requests wait",
         f"must be an integer in [{MIN_OUTBOX_BYTES}, {MAX_OUTBOX_BYTES}]", _parse_int_flag,
         _int_at_least(MIN_OUTBOX_BYTES, MAX_OUTBOX_BYTES), "BYTES", reloadable=True),
    _Key("stalled_client_timeout_s", "seconds a client may leave more than max_outbox_bytes unread before it is closed",
         "must be a number > 0 (seconds)", _parse_float_flag, _positive_number, "SECONDS", reloadable=True,
         normalise=float),
    _Key("hello_timeout_s", "seconds from connecting to a complete hello", "must be a number > 0 (seconds)",
         _parse_float_flag, _positive_number, "SECONDS", reloadable=True, normalise=float),
    _Key("frame_timeout_s", "seconds from a request frame's first byte to its last", "must be a number > 0 (seconds)",
         _parse_float_flag, _positive_number, "SECONDS", reloadable=True, normalise=float),
    _Key("max_context", "tokens one request may hold, prompt plus output", "must be an integer >= 2 (tokens)", _parse_int_flag, _int_at_least(2), "TOKENS"),
    _Key("default_max_tokens", "tokens generated when an ask sets no max_tokens", "must be an integer >= 1", _parse_int_flag, _int_at_least(1), "N",
         reloadable=True),
    _Key("parse_special_tokens_in_content", "let special-token text in chat messages become special tokens "
         "(transformers' behaviour; lets clients forge roles): true or false",
         "must be true or false", _parse_bool_flag, lambda v: isinstance(v, bool), "BOOL"),
    _Key("cache_size", 'memory for routed experts: bytes, "6G", "512M" or "40%" of MemAvailable or, if smaller, '
         'of the room left under the cgroup memory limit',
         'must be a size above 0: bytes (123), K/M/G/T ("512M", "6G") or a percentage of the memory budget ("40%")',
         _parse_int_flag, _is_size, "SIZE", reloadable=True),
    _Key("cache_policy", "expert cache eviction: lfu-decay, next-use, lfru or lru",
         'must be "lfu-decay", "next-use", "lfru" or "lru"', str,
         lambda v: v in ("lfu-decay", "next-use", "lfru", "lru"), "POLICY", reloadable=True),
    _Key("io_queue_depth", "expert reads in flight at most", "must be an integer in [1, 32]", _parse_int_flag,
         _int_at_least(1, 32), "N", reloadable=True),
    _Key("prefetch", "read the next layer's predicted experts early: lookahead or off",
         'must be "lookahead" or "off"', str, lambda v: v in ("lookahead", "off"), "MODE", reloadable=True),
    _Key("lookahead_predictor", "what lookahead guesses the next layer's experts from: router-on-moe-input "
         "(this layer's MoE input) or router-on-residual (the residual stream leaving this layer)",
         'must be "router-on-moe-input" or "router-on-residual"', str,
         lambda v: v in ("router-on-moe-input", "router-on-residual"), "PREDICTOR"),
    _Key("hugepages", 'backing of the expert cache: "auto", "thp", "off" or a number of 2 MiB pages',
         'must be "auto", "thp", "off" or a whole number of 2 MiB pages', _parse_hugepages_flag, _is_hugepages, "MODE"),
    _Key("lock_memory", "mlock the expert cache: required, try or off", 'must be "required", "try" or "off"', str,
         lambda v: v in ("required", "try", "off"), "MODE"),
    _Key("hugepage_record", "file where colibrid writes down the hugepages it raised, so the next start "
         "gives back those of a colibrid that was killed", "must be a non-empty path", str,
         lambda v: isinstance(v, str) and v != "", "PATH", normalise=Path),
    _Key("thermal", "throttle expert reads when the NVMe drive under the pack runs hot: auto or off",
         'must be "auto" or "off"', str, lambda v: v in ("auto", "off"), "MODE", reloadable=True),
    _Key("thermal_poll_s", "seconds between reads of the drive's temperature",
         f"must be a number >= {MIN_THERMAL_POLL_S:g} (seconds)", _parse_float_flag,
         _number_at_least(MIN_THERMAL_POLL_S), "SECONDS", reloadable=True, normalise=float),
    _Key("thermal_throttle", 'temperature (°C) above which expert reads are throttled, or "auto"',
         f'must be "auto" or a temperature in [{MIN_THERMAL_C:g}, {MAX_THERMAL_C:g}] (°C)', _parse_celsius_flag,
         _is_celsius_setting, "CELSIUS", reloadable=True, normalise=_celsius),
    _Key("thermal_resume", 'temperature (°C) below which throttled reads are restored, or "auto"',
         f'must be "auto" or a temperature in [{MIN_THERMAL_C:g}, {MAX_THERMAL_C:g}] (°C)', _parse_celsius_flag,
         _is_celsius_setting, "CELSIUS", reloadable=True, normalise=_celsius),
    _Key("shutdown_grace_s", "seconds accepted requests may still run after SIGTERM", "must be a number >= 0 (seconds)",
         _parse_float_flag, _number_at_least(0), "SECONDS", reloadable=True, normalise=float),
    _Key("stall_timeout_s", "seconds without a token on an accepted request before the health check fails",
         "must be a number > 0 (seconds)", _parse_float_flag, lambda v: _number_at_least(0)(v) and v > 0, "SECONDS",
         reloadable=True, normalise=float),
    _Key("cpu_affinity", 'CPUs for the engine thread: "auto" or a list like 0-3,8',
         '"auto" or a CPU list such as "0-3,8" naming CPUs colibrid may run on', str, _is_cpu_setting, "CPUS"),
    _Key("io_cpus", 'CPUs for the server and I/O threads: "auto" or a list like 4,5',
         '"auto" or a CPU list such as "4,5" naming CPUs colibrid may run on', str, _is_cpu_setting, "CPUS"),
    _Key("nice", "scheduling niceness set at start (negative needs CAP_SYS_NICE; 0 leaves it)",
         "must be an integer in [-20, 19]", _parse_int_flag, lambda v: _is_int(v) and -20 <= v <= 19, "N"),
    _Key("log_level", "how much to log to stderr", f"must be one of {', '.join(LOG_LEVELS)}", str, lambda v: v in LOG_LEVELS, "LEVEL",
         reloadable=True),
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
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_render(v) for v in value) + "]"
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
    parser.add_argument("--version", action="version", version=f"colibrid {__version__}")
    defaults = {f.name: f.default for f in dataclasses.fields(DaemonConfig)}
    for key in KEYS:
        default = defaults[key.name]
        shown_default = ", required" if default is dataclasses.MISSING else f", default {default}"
        # argparse %-formats help strings: a literal % ("40%" of MemAvailable) must be doubled.
        help_text = f"{key.meaning} (key {key.name}{shown_default})".replace("%", "%%")
        parser.add_argument(flag_name(key.name), dest=key.name, metavar=key.flag_metavar, default=None,
                            help=help_text)
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


def _check_thermal_hysteresis(values: dict[str, Any]) -> None:
    """Resuming at or above the throttle temperature would flap at every poll."""
    throttle, resume = values.get("thermal_throttle", "auto"), values.get("thermal_resume", "auto")
    if throttle != "auto" and resume != "auto" and resume >= throttle:
        raise ConfigError(f"thermal_resume = {resume:g} must be below thermal_throttle = {throttle:g} "
                          "(the gap keeps the throttle from switching on and off at every poll)")


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
        values[key.name] = key.normalise(value)

    if "model" not in values:
        raise ConfigError(f"model is not set: pass --model PATH or set model in {config_path}")
    _check_thermal_hysteresis(values)
    for path_key in ("model", "socket"):
        if path_key in values:
            values[path_key] = Path(values[path_key])
    return DaemonConfig(**values)
