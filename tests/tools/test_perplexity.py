"""colibri-perplexity: llama-perplexity's windows and scores, the f32 perplexity equal to
transformers' on the same windows, KL against a base, and the command's errors and output."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from colibrid.engine import load
from colibrid.tools.perplexity import main, measure, text_ids
from colibrid.tools.quality import Totals, WindowScores, score_window, scored_positions, windows

CONTEXT = 32
WINDOWS = 6


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    """A tiny random OLMoE checkpoint, its f32 and q8_0 packs, and a text of at least WINDOWS windows."""
    from tests.tiny_checkpoints import CORPUS, CheckpointSpec, build_checkpoint
    from colibrid.tools.convert.converter import convert
    from colibrid.tools.convert.quant_spec import parse_quant

    root = tmp_path_factory.mktemp("perplexity")
    checkpoint = build_checkpoint(CheckpointSpec("olmoe"), root / "checkpoint")
    for quant in ("f32", "q8_0"):
        convert(checkpoint, root / quant, parse_quant(quant), progress=False)
    text = root / "text.txt"
    text.write_text("".join(CORPUS) * 8)
    return {"checkpoint": checkpoint, "f32": root / "f32", "q8_0": root / "q8_0", "text": text, "root": root}


# --- the rule, on hand-checked cases ---

def test_windows_are_consecutive_slices_and_the_remainder_is_dropped():
    assert windows(np.arange(10), 4).tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert windows(np.arange(10), 4, max_windows=1).tolist() == [[0, 1, 2, 3]]


def test_a_vocabulary_that_adds_bos_starts_every_window_with_it():
    assert windows(np.arange(10), 4, bos_id=99).tolist() == [[99, 1, 2, 3], [99, 5, 6, 7]]


def test_a_text_shorter_than_one_window_is_refused():
    with pytest.raises(ValueError, match="shorter than one window"):
        windows(np.arange(3), 4)


def test_the_second_half_of_a_window_is_scored_as_llama_perplexity_scores_it():
    assert scored_positions(8) == (slice(4, 7), slice(5, 8))  # logits at 4, 5, 6 predict tokens 5, 6, 7
    rows, targets = scored_positions(512)
    assert rows.stop - rows.start == 255 and targets.start == 257  # 512 - 512/2 - 1, as llama.cpp


def test_scores_of_a_hand_computed_window():
    # two rows over a vocabulary of 2: uniform, then log-odds 3 for token 1
    logits = np.array([[0.0, 0.0], [0.0, 3.0]])
    scores, _ = score_window(logits, np.array([0, 1]))
    assert np.allclose(scores.nll, [math.log(2), math.log(1 + math.exp(-3))])
    assert scores.top1.tolist() == [0, 1]
    totals = Totals()
    totals.add(scores)
    assert totals.summary()["perplexity"] == pytest.approx(math.exp(scores.nll.mean()))


def test_kl_divergence_and_top1_agreement_against_a_base():
    base_logits = np.array([[0.0, 0.0], [0.0, 3.0]])
    base, base_log_probs = score_window(base_logits, np.array([0, 1]))
    # the candidate puts p = (0.75, 0.25) on the uniform row: KL(u || p) = 0.5 ln(0.5/0.75) + 0.5 ln(0.5/0.25)
    candidate, _ = score_window(np.array([[math.log(3), 0.0], [0.0, 3.0]]), np.array([0, 1]), base_log_probs)
    expected = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    assert candidate.kl == pytest.approx([expected, 0.0], abs=1e-12)
    totals = Totals()
    totals.add(candidate, base)
    summary = totals.summary()
    assert summary["top1_agreement"] == 1.0  # argmax of a tie is token 0 in both
    assert summary["kl_mean"] == pytest.approx(expected / 2)
    assert summary["dppl"] == pytest.approx(summary["perplexity"] - summary["base_perplexity"])
    totals.add(WindowScores(np.array([1.0]), np.array([1]), np.array([0.0])), WindowScores(np.array([1.0]), np.array([0])))
    assert totals.summary()["top1_agreement"] == pytest.approx(2 / 3)


# --- on a model ---

def test_f32_perplexity_equals_transformers_on_the_same_windows(packs):
    from tests.tiny_checkpoints import load_reference, reference_logits

    engine = load(packs["f32"], max_context=CONTEXT)
    ids = text_ids(engine, packs["text"].read_text())
    report = measure(engine, ids, CONTEXT, max_windows=WINDOWS)

    reference = load_reference(packs["checkpoint"])
    rows, targets = scored_positions(CONTEXT)
    nll = []
    for window in windows(ids, CONTEXT, max_windows=WINDOWS):
        logits = reference_logits(reference, window.tolist())[rows].astype(np.float64)
        log_probs = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) \
            - logits.max(1, keepdims=True)
        nll.extend(-log_probs[np.arange(len(log_probs)), window[targets]])
    expected = math.exp(np.mean(nll))

    assert report["windows"] == WINDOWS and report["scored_tokens"] == WINDOWS * (CONTEXT - CONTEXT // 2 - 1)
    assert report["perplexity"] == pytest.approx(expected, rel=1e-3)


def test_a_pack_against_itself_has_no_divergence(packs):
    engine = load(packs["f32"], max_context=CONTEXT)
    ids = text_ids(engine, packs["text"].read_text())
    report = measure(engine, ids, CONTEXT, base=load(packs["f32"], max_context=CONTEXT), max_windows=WINDOWS)
    assert report["kl_mean"] == pytest.approx(0.0, abs=1e-9)
    assert report["top1_agreement"] == 1.0 and report["dppl"] == pytest.approx(0.0, abs=1e-9)


def test_q8_0_against_its_f32_base_diverges_a_little(packs):
    engine = load(packs["q8_0"], max_context=CONTEXT)
    ids = text_ids(engine, packs["text"].read_text())
    report = measure(engine, ids, CONTEXT, base=load(packs["f32"], max_context=CONTEXT), max_windows=WINDOWS)
    assert 0.0 < report["kl_mean"] < 0.01
    assert report["kl_p99"] >= report["kl_mean"]
    assert report["top1_agreement"] > 0.9


def test_several_windows_per_step_give_each_window_s_numbers_alone(packs, monkeypatch):
    from colibrid.tools import perplexity

    engine = load(packs["f32"], max_context=CONTEXT)
    ids = text_ids(engine, packs["text"].read_text())
    batched = measure(engine, ids, CONTEXT, max_windows=WINDOWS)
    monkeypatch.setattr(perplexity, "windows_per_step", lambda *args: 1)
    alone = measure(engine, ids, CONTEXT, max_windows=WINDOWS)
    assert batched["perplexity"] == pytest.approx(alone["perplexity"], rel=1e-6)


# --- the command ---

def test_json_report(packs, capsys):
    code = main([str(packs["q8_0"]), str(packs["text"]), "--base", str(packs["f32"]), "--context", str(CONTEXT),
                 "--windows", "2", "--json", "--quiet"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["windows"] == 2 and report["context"] == CONTEXT and report["base"] == str(packs["f32"])
    for key in ("perplexity", "base_perplexity", "dppl", "kl_mean", "kl_p99", "top1_agreement", "tokens_per_s"):
        assert isinstance(report[key], float), key


def test_text_report_and_progress(packs, capsys):
    assert main([str(packs["f32"]), str(packs["text"]), "--context", str(CONTEXT), "--windows", "2"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("2 windows of 32 tokens") and "perplexity" in out and "mean KL" not in out
    assert "windows 2/2" in err and "tokens/s" in err


def test_a_short_text_is_an_error(packs, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("def f(): pass\n")
    assert main([str(packs["f32"]), str(short), "--context", str(CONTEXT), "--quiet"]) == 1
    assert "shorter than one window of 32" in capsys.readouterr().err


def test_packs_with_different_vocabularies_are_an_error(packs, capsys):
    from colibrid.tools.convert.converter import convert
    from colibrid.tools.convert.quant_spec import parse_quant
    from colibrid.tools.demo import build_demo_checkpoint

    other = packs["root"] / "demo"
    if not other.exists():
        convert(build_demo_checkpoint(packs["root"] / "demo-checkpoint"), other, parse_quant("q8_0"), progress=False)
    assert main([str(packs["f32"]), str(packs["text"]), "--base", str(other), "--context", str(CONTEXT), "--quiet"]) == 1
    assert "different vocabularies" in capsys.readouterr().err


def test_a_missing_pack_is_an_error(packs, tmp_path, capsys):
    assert main([str(tmp_path / "nothing"), str(packs["text"]), "--quiet"]) == 1
    assert "colibri-perplexity: error:" in capsys.readouterr().err



def test_windows_longer_than_a_step_run_in_steps_with_the_same_numbers(packs):
    engine = load(packs["f32"], max_context=CONTEXT)
    ids = text_ids(engine, packs["text"].read_text())
    whole = measure(engine, ids, CONTEXT, max_windows=WINDOWS)
    engine.model.max_step_tokens = 5  # before any state is made: 32 tokens in 7 steps, the scored half from the 4th
    stepped = measure(engine, ids, CONTEXT, max_windows=WINDOWS)
    assert stepped["perplexity"] == pytest.approx(whole["perplexity"], rel=1e-6)
