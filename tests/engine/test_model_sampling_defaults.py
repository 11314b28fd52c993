"""A checkpoint's generation_config.json sets the sampling a request gets when it names none."""

from __future__ import annotations

import json
import logging

from colibrid.engine.sampling import model_sampling_defaults


def test_do_sample_true_takes_the_file_s_settings():
    config = {"eos_token_id": 3, "do_sample": True, "temperature": 0.7, "top_p": 0.95, "top_k": 40, "min_p": 0.05}
    assert model_sampling_defaults(config) == {"temperature": 0.7, "top_p": 0.95, "top_k": 40, "min_p": 0.05}


def test_do_sample_false_means_greedy_like_transformers():
    assert model_sampling_defaults({"do_sample": False, "temperature": 0.6}) == {"temperature": 0.0}


def test_a_file_silent_about_sampling_leaves_colibri_s_defaults():
    assert model_sampling_defaults({"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.6}) == {}


def test_repetition_penalty_applies_with_or_without_sampling():
    assert model_sampling_defaults({"repetition_penalty": 1.1}) == {"repetition_penalty": 1.1}
    assert model_sampling_defaults({"do_sample": False, "repetition_penalty": 1.1}) == {
        "temperature": 0.0, "repetition_penalty": 1.1}


def test_out_of_range_values_are_ignored_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        defaults = model_sampling_defaults({"do_sample": True, "temperature": 0.8, "top_p": 1.5, "top_k": "many"})
    assert defaults == {"temperature": 0.8}
    assert "top_p" in caplog.text and "top_k" in caplog.text


def test_the_engine_reads_the_pack_s_generation_config(tmp_path):
    from colibrid.tools.convert.converter import convert
    from colibrid.tools.convert.quant_spec import parse_quant
    from colibrid.tools.demo import build_demo_checkpoint
    from colibrid.engine import load

    pack = tmp_path / "pack"
    convert(build_demo_checkpoint(tmp_path / "checkpoint"), pack, parse_quant("q8_0"), progress=False)
    (pack / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.5}))
    assert load(pack).sampling_defaults == {"temperature": 0.5}
    (pack / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert load(pack).sampling_defaults == {}
