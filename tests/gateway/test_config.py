"""colibri-openai's settings: the shipped file holds every key at its default, flags override
the file, and a bad key or value stops the start with one line naming it."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from colibrid.gateway.config import GATEWAY_SETTINGS, ConfigError, GatewayConfig, load_config, parse_listen

SHIPPED = Path(__file__).resolve().parents[2] / "etc/colibri/colibri-openai.toml"


def test_the_shipped_file_documents_every_key_at_its_default():
    text = SHIPPED.read_text()
    commented = "\n".join(line[1:] for line in text.splitlines() if re.match(r"#\w+ = ", line))
    defaults = tomllib.loads(commented)
    assert defaults == {f.name: getattr(GatewayConfig(), f.name) for f in dataclasses.fields(GatewayConfig)}


def test_flags_override_the_file(tmp_path):
    config_file = tmp_path / "gateway.toml"
    config_file.write_text('listen = "[::1]:9000"\nretry_after_s = 5\ndaemon_timeout_s = 3\n')
    config = load_config(["--config", str(config_file), "--retry-after-s", "7"])
    assert (config.listen, config.retry_after_s, config.daemon_timeout_s) == ("[::1]:9000", 7, 3.0)
    assert parse_listen(config.listen) == ("::1", 9000)


@pytest.mark.parametrize("content, flags, message", [
    ('lissen = "x"\n', [], "unknown key 'lissen'"),
    ('tool_call_format = "xml"\n', [], 'tool_call_format = "xml"'),
    ("", ["--listen", "localhost"], 'listen = "localhost": must be HOST:PORT'),
    ("", ["--max-request-bytes", "many"], 'max_request_bytes = "many": must be an integer >= 1 (from --max-request-bytes)'),
    ("", ["--retry-after-s", "0"], "retry_after_s = 0"),
])
def test_a_bad_setting_is_one_line_naming_it(tmp_path, content, flags, message):
    config_file = tmp_path / "gateway.toml"
    config_file.write_text(content)
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        load_config(["--config", str(config_file), *flags])
    assert "\n" not in str(caught.value)


def test_the_shipped_file_is_written_from_the_key_table():
    """Each key is described once, in colibrid/gateway/config.py; the shipped file follows."""
    assert SHIPPED.read_text() == GATEWAY_SETTINGS.documented_toml(), (
        f"{SHIPPED} differs from the keys of colibrid/gateway/config.py: write it again with "
        "python -m colibrid.gateway.config > etc/colibri/colibri-openai.toml")


def test_every_key_of_the_shipped_file_is_a_flag():
    """docs/gateway.md says so: max_request_bytes <-> --max-request-bytes."""
    keys = re.findall(r"^#?(\w+) = ", SHIPPED.read_text(), re.MULTILINE)
    assert keys == [f.name for f in dataclasses.fields(GatewayConfig)]
    parser = GATEWAY_SETTINGS.arg_parser()
    for key in keys:
        assert vars(parser.parse_args(["--" + key.replace("_", "-"), "x"]))[key] == "x", key
