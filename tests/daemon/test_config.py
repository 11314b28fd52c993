"""Settings: defaults, the TOML file, flags over the file, and one-line errors at start."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from colibrid.daemon.config import DAEMON_SETTINGS, KEYS, ConfigError, DaemonConfig, build_arg_parser, load_config

REPO = Path(__file__).resolve().parents[2]
SHIPPED_CONFIG = REPO / "etc" / "colibri" / "colibrid.toml"


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "colibrid.toml"
    path.write_text(text)
    return path


def test_defaults(demo_pack, tmp_path):
    config = load_config(["--config", str(write_config(tmp_path, "")), "--model", str(demo_pack)])
    assert config == DaemonConfig(model=demo_pack)
    assert (config.socket, config.max_queue, config.max_frame_bytes, config.max_context,
            config.default_max_tokens, config.log_level) == (
        Path("/run/colibri/colibrid.sock"), 16, 1048576, 4096, 256, "info")


def test_flags_override_the_file(demo_pack, tmp_path):
    path = write_config(tmp_path, f'model = "{demo_pack}"\nmax_queue = 3\nlog_level = "debug"\n')
    config = load_config(["--config", str(path), "--max-queue", "5", "--socket", "/tmp/x.sock"])
    assert (config.model, config.max_queue, config.log_level, config.socket) == (
        demo_pack, 5, "debug", Path("/tmp/x.sock"))


def test_kv_cache_type_is_f32_unless_set(demo_pack, tmp_path):
    assert load_config(["--config", str(write_config(tmp_path, "")), "--model", str(demo_pack)]).kv_cache_type == "f32"
    from_file = write_config(tmp_path, f'model = "{demo_pack}"\nkv_cache_type = "f16"\n')
    assert load_config(["--config", str(from_file)]).kv_cache_type == "f16"
    assert load_config(["--config", str(from_file), "--kv-cache-type", "f32"]).kv_cache_type == "f32"


def test_special_tokens_in_content_stay_text_unless_opted_in(demo_pack, tmp_path):
    assert load_config(["--config", str(write_config(tmp_path, "")), "--model", str(demo_pack)]
                       ).parse_special_tokens_in_content is False
    from_file = write_config(tmp_path, f'model = "{demo_pack}"\nparse_special_tokens_in_content = true\n')
    assert load_config(["--config", str(from_file)]).parse_special_tokens_in_content is True
    assert load_config(["--config", str(from_file), "--parse-special-tokens-in-content", "false"]
                       ).parse_special_tokens_in_content is False


@pytest.mark.parametrize("file_text, flags, expected", [
    ("max_queue = -1\n", [], "max_queue = -1: must be an integer >= 1"),
    ('cache_size = "lots"\n', [], 'cache_size = "lots": must be a size above 0'),
    ("", ["--cache-size", "0"], "cache_size = 0: must be a size above 0"),
    ("", ["--prefetch", "maybe"], 'prefetch = "maybe": must be "lookahead" or "off"'),
    ('lookahead_predictor = "probe"\n', [], 'lookahead_predictor = "probe": must be "router-on-moe-input" or '
                                            '"router-on-residual"'),
    ("hugepages = -3\n", [], 'hugepages = -3: must be "auto", "thp", "off" or a whole number'),
    ('kv_cache_type = "bf16"\n', [], 'kv_cache_type = "bf16": must be "f32" or "f16"'),
    ("", ["--kv-cache-type", "q8_0"], 'kv_cache_type = "q8_0": must be "f32" or "f16"'),
    ("", ["--io-queue-depth", "99"], "io_queue_depth = 99: must be an integer in [1, 32]"),
    ("", ["--max-queue", "-1"], "max_queue = -1: must be an integer >= 1"),
    ("", ["--max-queue", "many"], 'max_queue = "many": must be an integer >= 1'),
    ('max_queue = "4"\n', [], 'max_queue = "4": must be an integer >= 1'),
    ("max_frame_bytes = 10\n", [], "max_frame_bytes = 10: must be an integer in [1024, 67108864]"),
    ('log_level = "loud"\n', [], 'log_level = "loud": must be one of error, warning, info, debug'),
    ("", ["--default-max-tokens", "0"], "default_max_tokens = 0: must be an integer >= 1"),
    ("", ["--max-context", "1"], "max_context = 1: must be an integer >= 2 (tokens)"),
    ("", ["--socket", "/" + "s" * 200], "socket = "),
    ("max_queues = 3\n", [], "unknown key 'max_queues'"),
    ('thermal = "on"\n', [], 'thermal = "on": must be "auto" or "off"'),
    ("", ["--thermal-poll-s", "0.2"], "thermal_poll_s = 0.2: must be a number >= 1 (seconds)"),
    ('thermal_throttle = "hot"\n', [], 'thermal_throttle = "hot": must be "auto" or a temperature in [20, 120]'),
    ("", ["--thermal-resume", "400"], 'thermal_resume = 400.0: must be "auto" or a temperature in [20, 120]'),
    ("thermal_throttle = 70\nthermal_resume = 70\n", [], "thermal_resume = 70 must be below thermal_throttle = 70"),
    ("max_queue = \n", [], "is not valid TOML"),
    ("", ["--parse-special-tokens-in-content", "yes"], 'parse_special_tokens_in_content = "yes": must be true or false'),
    ('parse_special_tokens_in_content = "true"\n', [], 'parse_special_tokens_in_content = "true": must be true or false'),
])
def test_a_bad_value_names_the_key_the_value_and_what_is_allowed(demo_pack, tmp_path, file_text, flags, expected):
    path = write_config(tmp_path, file_text)
    with pytest.raises(ConfigError) as caught:
        load_config(["--config", str(path), "--model", str(demo_pack), *flags])
    message = str(caught.value)
    assert expected in message and "\n" not in message


def test_thermal_thresholds_are_auto_or_degrees(demo_pack, tmp_path):
    path = write_config(tmp_path, "thermal_throttle = 70\n")
    config = load_config(["--config", str(path), "--model", str(demo_pack), "--thermal-resume", "62.5"])
    assert (config.thermal, config.thermal_poll_s, config.thermal_throttle, config.thermal_resume) == (
        "auto", 5.0, 70.0, 62.5)
    assert load_config(["--config", str(path), "--model", str(demo_pack), "--thermal-throttle", "auto"]
                       ).thermal_throttle == "auto"


def test_model_is_required_and_must_be_a_pack_directory(tmp_path):
    path = write_config(tmp_path, "")
    with pytest.raises(ConfigError, match="model is not set"):
        load_config(["--config", str(path)])
    with pytest.raises(ConfigError, match=r'model = ".*nowhere": must be the path of a pack directory'):
        load_config(["--config", str(path), "--model", str(tmp_path / "nowhere")])


def test_the_shipped_file_documents_every_key_with_its_default(demo_pack):
    text = SHIPPED_CONFIG.read_text()
    for key in KEYS:
        assert f"{key.name} = " in text, f"{key.name} is not documented in {SHIPPED_CONFIG}"
    # Uncommenting every commented key must give back exactly the defaults.
    uncommented = "\n".join(line.removeprefix("#") if line.startswith("#") and " = " in line else line
                            for line in text.splitlines())
    table = tomllib.loads(uncommented)
    defaults = DaemonConfig(model=Path(table["model"]))
    for key in KEYS:
        if key.name != "model":
            default = getattr(defaults, key.name)
            expected = str(default) if isinstance(default, Path) else list(default) if isinstance(default, tuple) else default
            assert table[key.name] == expected, key.name


def test_the_shipped_file_is_written_from_the_key_table():
    """Each key is described once, in colibrid/daemon/config.py; the shipped file follows."""
    assert SHIPPED_CONFIG.read_text() == DAEMON_SETTINGS.documented_toml(), (
        f"{SHIPPED_CONFIG} differs from the keys of colibrid/daemon/config.py: write it again with "
        "python -m colibrid.daemon.config > etc/colibri/colibrid.toml")


def test_every_key_of_the_shipped_file_is_a_flag():
    """The README says so: max_queue <-> --max-queue."""
    keys = re.findall(r"^#?(\w+) = ", SHIPPED_CONFIG.read_text(), re.MULTILINE)
    assert keys == [key.name for key in KEYS]
    parser = build_arg_parser()
    for key in keys:
        assert vars(parser.parse_args(["--" + key.replace("_", "-"), "x"]))[key] == "x", key


def test_the_keys_a_reload_applies():
    """Daemon.apply_reload applies exactly these; the shipped file says so key by key."""
    assert {key.name for key in KEYS if key.reloadable} == {
        "allow_users", "allow_groups", "max_queue", "max_frame_bytes", "max_connections", "max_outbox_bytes",
        "stalled_client_timeout_s", "hello_timeout_s", "frame_timeout_s", "default_max_tokens", "cache_size",
        "cache_policy", "io_queue_depth", "prefetch", "thermal", "thermal_poll_s", "thermal_throttle",
        "thermal_resume", "shutdown_grace_s", "stall_timeout_s", "log_level"}


@pytest.mark.parametrize("source", ["file", "flag"])
def test_the_daemon_exits_2_with_one_line_on_stderr(demo_pack, tmp_path, source):
    path = write_config(tmp_path, "max_queue = -1\n" if source == "file" else "")
    flags = ["--max-queue", "-1"] if source == "flag" else []
    result = subprocess.run([sys.executable, "-m", "colibrid", "--config", str(path), "--model", str(demo_pack),
                             "--socket", str(tmp_path / "s.sock"), *flags],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("colibrid: config error: max_queue = -1: must be an integer >= 1")
    assert not (tmp_path / "s.sock").exists()


def test_help_shows_every_key():
    """argparse %-formats help text: a literal % ("40%" of MemAvailable) once broke --help."""
    text = build_arg_parser().format_help()
    assert all(f"--{key.name.replace('_', '-')}" in text for key in KEYS)
    assert '"40%" of MemAvailable' in text
