"""colibrid.settings, on a small program of its own: one table of keys gives the flags, the
loading (defaults, file, flags), the one-line errors and the shipped file."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from colibrid.settings import (BOOLEAN, LOG_LEVEL, REQUIRED, Check, ConfigError, ProgramSettings, flag_name, integer,
                               keys_of, number, one_of, setting, toml_value)


@dataclass(frozen=True)
class ToyConfig:
    name: str = setting(REQUIRED, Check("must be a word", str.isalpha), "WORD", example="colibri", doc="""
        What the toy is called.""")
    max_queue: int = setting(16, integer(1), "N", reloadable=True, heading="Limits", doc="""
        Requests that may wait.

        One more is refused: 40% of them would not be.""")
    timeout_s: float = setting(10.0, number(0, above=True, unit="seconds"), "SECONDS", doc="Seconds to wait.")
    verbose: bool = setting(False, BOOLEAN, "BOOL", doc="Say more.")
    mode: str = setting("fast", one_of("fast", "slow"), "MODE", reloadable=True, doc="How to run.")
    log_level: str = setting("info", LOG_LEVEL, "LEVEL", doc="How much to log.")


def _low_before_high(values: dict) -> None:
    if values.get("max_queue", 16) < 2 and values.get("mode") == "slow":
        raise ConfigError("mode = \"slow\" needs max_queue >= 2", key="mode")


TOY = ProgramSettings(program="toy", config_type=ToyConfig, default_path=Path("/nonexistent/toy.toml"),
                      description="A toy.", file_header="The toy's settings.", reloads=True,
                      check_together=_low_before_high)


def load(tmp_path: Path, text: str, *flags: str) -> ToyConfig:
    path = tmp_path / "toy.toml"
    path.write_text(text)
    return TOY.load(["--config", str(path), *flags])


def test_one_rule_names_every_flag():
    assert flag_name("max_queue") == "--max-queue"
    assert [key.flag for key in TOY.keys] == ["--name", "--max-queue", "--timeout-s", "--verbose", "--mode",
                                             "--log-level"]


def test_the_keys_are_the_dataclass_fields_in_order():
    keys = TOY.keys
    assert [key.name for key in keys] == [field.name for field in dataclasses.fields(ToyConfig)]
    assert keys[0].required and keys[0].default is REQUIRED and not keys[1].required
    assert (keys[1].default, keys[1].reloadable, keys[1].summary) == (16, True, "Requests that may wait.")


def test_a_field_not_declared_as_a_setting_is_refused():
    @dataclass(frozen=True)
    class Loose:
        count: int = 3

    with pytest.raises(TypeError, match="Loose.count is not declared with setting"):
        keys_of(Loose)


def test_defaults_then_the_file_then_the_flags(tmp_path):
    assert load(tmp_path, 'name = "wren"\n') == ToyConfig(name="wren")
    config = load(tmp_path, 'name = "wren"\nmax_queue = 3\ntimeout_s = 2\nmode = "slow"\n', "--max-queue", "5",
                  "--verbose", "true")
    assert config == ToyConfig(name="wren", max_queue=5, timeout_s=2.0, verbose=True, mode="slow")
    assert isinstance(config.timeout_s, float)  # an integer in the file, normalised


@pytest.mark.parametrize("text, flags, message, key, source", [
    ('name = "wren"\nmax_queue = 0\n', [], "max_queue = 0: must be an integer >= 1 (from {path})", "max_queue",
     "{path}"),
    ('name = "wren"\n', ["--max-queue", "many"], 'max_queue = "many": must be an integer >= 1 (from --max-queue)',
     "max_queue", "--max-queue"),
    ('name = "wren"\n', ["--timeout-s", "0"], "timeout_s = 0.0: must be a number > 0 (seconds) (from --timeout-s)",
     "timeout_s", "--timeout-s"),
    ('name = "wren"\nverbose = "yes"\n', [], 'verbose = "yes": must be true or false', "verbose", "{path}"),
    ('name = "wren"\nmode = "medium"\n', [], 'mode = "medium": must be "fast" or "slow"', "mode", "{path}"),
    ('name = "wren"\nlog_level = "loud"\n', [], 'log_level = "loud": must be one of error, warning, info, debug',
     "log_level", "{path}"),
    ('name = "wren"\nmax_queues = 3\n', [],
     "unknown key 'max_queues' in {path}; known keys: name, max_queue, timeout_s, verbose, mode, log_level",
     "max_queues", "{path}"),
    ("", [], "name is not set: pass --name WORD or set name in {path}", "name", None),
    ('name = "wren"\nmax_queue = 1\nmode = "slow"\n', [], 'mode = "slow" needs max_queue >= 2', "mode", None),
    ("name = \n", [], "{path} is not valid TOML", None, "{path}"),
])
def test_a_bad_setting_is_one_line_naming_the_key_the_value_and_what_is_allowed(tmp_path, text, flags, message,
                                                                               key, source):
    path = tmp_path / "toy.toml"
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, text, *flags)
    assert message.format(path=path) in str(caught.value) and "\n" not in str(caught.value)
    assert (caught.value.key, caught.value.source) == (key, source and source.format(path=path))


def test_a_missing_file_is_an_error_only_when_named(tmp_path):
    assert TOY.load(["--name", "wren"]) == ToyConfig(name="wren")  # the default path does not exist
    with pytest.raises(ConfigError, match="cannot read config file .*absent.toml: No such file or directory"):
        TOY.load(["--config", str(tmp_path / "absent.toml"), "--name", "wren"])


def test_help_shows_each_key_with_its_summary_and_default():
    text = " ".join(TOY.arg_parser().format_help().split())
    assert "--max-queue N Requests that may wait. (key max_queue, default 16)" in text
    assert "--name WORD What the toy is called. (key name, required)" in text
    assert '--mode MODE How to run. (key mode, default "fast")' in text


def test_the_shipped_file_describes_every_key_and_gives_its_default():
    text = TOY.documented_toml()
    assert text.startswith("# The toy's settings.\n")
    assert ("\n# ---- Limits ----\n\n"
            "# Requests that may wait.\n#\n# One more is refused: 40% of them would not be.\n"
            "# Must be an integer >= 1. Reloadable.\n#max_queue = 16\n") in text
    assert ("# What the toy is called.\n"
            "# Must be a word. Required; no default. Takes effect at the next restart.\nname = \"colibri\"\n") in text
    # Uncommented, the file is the defaults.
    uncommented = "\n".join(line[1:] if line.startswith("#") and " = " in line else line for line in text.splitlines())
    assert tomllib.loads(uncommented) == {"name": "colibri", **{f.name: f.default for f in dataclasses.fields(ToyConfig)
                                                                if f.name != "name"}}


def test_a_description_wraps_at_the_comment_width():
    @dataclass(frozen=True)
    class Wordy:
        words: str = setting("", Check("must be text", lambda v: isinstance(v, str)), "TEXT", doc="word " * 60)

    lines = ProgramSettings("wordy", Wordy, Path("/x"), "", "Wordy.").documented_toml().splitlines()
    assert max(len(line) for line in lines) <= 95 and sum(line.startswith("# word") for line in lines) == 4


def test_values_are_written_as_toml():
    assert [toml_value(v) for v in ('say "hi"', Path("/run/x.sock"), True, (), ("a", 1), 2.5)] == [
        '"say \\"hi\\""', '"/run/x.sock"', "true", "[]", '["a", 1]', "2.5"]
