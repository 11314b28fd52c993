"""tools/evaluation_text.py rebuilds a default model's validation text with training's own split."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import evaluation_text  # noqa: E402
import train_default_model  # noqa: E402


def test_the_split_is_training_s_own_function():
    assert evaluation_text.is_validation is train_default_model.is_validation
    assert evaluation_text.stdlib_files is train_default_model.stdlib_files


def test_it_selects_exactly_the_validation_files_of_training():
    root, files = train_default_model.stdlib_files()
    names = [str(p.relative_to(root)) for p in files]
    selected = evaluation_text.validation_files()
    assert list(selected) == [name for name in names if train_default_model.is_validation(name)]
    assert 0 < len(selected) < len(names) / 10


def test_the_text_is_the_files_each_ended_by_eos(tmp_path):
    out = tmp_path / "validation.txt"
    assert evaluation_text.main([str(REPO / "models/colibri-olmoe-stdlib"), str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    files = evaluation_text.validation_files()
    assert text.count(train_default_model.EOS) == len(files)
    assert text.startswith(next(iter(files.values())))


MODELS = ["colibri-olmoe-stdlib", "colibri-olmoe64-stdlib"]


@pytest.mark.parametrize("name", MODELS)
def test_on_the_python_it_was_trained_on_the_tokens_are_the_model_card_s(name, tmp_path):
    from colibrid.engine.text.tokenizer import Tokenizer

    model = REPO / "models" / name
    training = json.loads((model / "training.json").read_text())
    if training["corpus"]["python_version"] != platform.python_version():
        pytest.skip(f"{name} was trained on another Python's sources")
    out = tmp_path / "validation.txt"
    evaluation_text.main([str(model), str(out)])
    tokenizer = Tokenizer.from_dir(model)
    assert len(tokenizer.encode(out.read_text(encoding="utf-8"), add_special_tokens=False)) == \
        training["validation_tokens"]
