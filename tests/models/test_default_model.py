"""The shipped trained models (models/colibri-olmoe-stdlib, the default, and
models/colibri-olmoe64-stdlib, 64 experts) through Colibri.

Golden: greedy continuations recorded by tools/record_golden.py when the model was trained
— the default-quantized pack must keep producing exactly those ids, and a bf16 pack (which
holds the checkpoint's weights exactly) must produce transformers' own greedy ids. Oracle:
the trained checkpoint's logits through Colibri equal transformers' on real Python text.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

MODELS = Path(__file__).resolve().parents[2] / "models"
SHIPPED = ["colibri-olmoe-stdlib", "colibri-olmoe64-stdlib"]

# Not in the training data's form (it is written here), but the kind of text the model knows.
PYTHON_TEXT = '''import json
import os


def load_settings(path, defaults=None):
    """Read a JSON settings file, falling back to defaults for missing keys."""
    settings = dict(defaults or {})
    if not os.path.exists(path):
        return settings
    with open(path, encoding="utf-8") as f:
        settings.update(json.load(f))
    return settings


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key):
        self.counts[key] = self.counts.get(key, 0) + 1
'''


@pytest.fixture(scope="module", params=SHIPPED)
def model(request) -> Path:
    return MODELS / request.param


@pytest.fixture(scope="module")
def golden(model) -> dict:
    return json.loads((model / "golden.json").read_text())


def _convert(model: Path, tmp_path_factory, quant: str | None) -> Path:
    from colibrid.tools.convert.converter import convert
    from colibrid.tools.convert.quant_spec import parse_quant

    out = tmp_path_factory.mktemp(model.name) / "model.pack"
    convert(model, out, parse_quant(quant), progress=False)
    return out


@pytest.fixture(scope="module")
def default_engine(model, tmp_path_factory):
    from colibrid.engine import load

    return load(_convert(model, tmp_path_factory, None))


@pytest.fixture(scope="module")
def bf16_engine(model, tmp_path_factory):
    from colibrid.engine import load

    return load(_convert(model, tmp_path_factory, "bf16"))


@pytest.fixture(scope="module")
def reference(model):
    pytest.importorskip("transformers")
    from tests.tiny_checkpoints import load_reference

    return load_reference(model)


def test_golden_was_recorded_with_the_current_default_quantization(golden):
    from colibrid.tools.convert.quant_spec import parse_quant

    # A new default changes the default pack's function: re-record (tools/record_golden.py).
    assert golden["default_quant"] == parse_quant(None).to_json()


def test_default_pack_reproduces_the_recorded_greedy_continuations(default_engine, golden):
    for record in golden["prompts"]:
        assert default_engine.prompt_ids(record["prompt"], raw=True) == record["prompt_ids"]
        assert default_engine.greedy(record["prompt_ids"], golden["greedy_tokens"]) == record["default_pack"], record["prompt"]


def test_bf16_pack_reproduces_transformers_recorded_greedy_continuations(bf16_engine, golden):
    for record in golden["prompts"]:
        assert bf16_engine.greedy(record["prompt_ids"], golden["greedy_tokens"]) == record["transformers"], record["prompt"]


def test_trained_model_logits_match_transformers(bf16_engine, reference):
    from tests.tiny_checkpoints import assert_same_logits

    ids = bf16_engine.prompt_ids(PYTHON_TEXT, raw=True)
    assert len(ids) > 100
    assert_same_logits(reference, bf16_engine, ids)


def test_default_quantization_keeps_the_trained_model_s_predictions(default_engine, reference):
    """The README's pack is 4-bit experts and 8-bit dense weights: on real text it must
    still pick transformers' top token almost everywhere (docs/quantization.md)."""
    from tests.tiny_checkpoints import reference_logits

    ids = default_engine.prompt_ids(PYTHON_TEXT, raw=True)
    expected = reference_logits(reference, ids)
    actual = default_engine.forward(ids)
    agreement = float(np.mean(actual.argmax(-1) == expected.argmax(-1)))
    assert agreement >= 0.97, agreement
