"""Quantized packs are measured against the f32 pack, not assumed: teacher-forced
top-1 agreement and mean KL divergence of the next-token distributions.

The models are briefly trained on the tiny corpus and measured on it: a random model's
next-token distribution is nearly flat, so any perturbation flips its argmax, which says
nothing about a quantization's quality on real models."""

from __future__ import annotations

import numpy as np
import pytest

from tests.tiny_checkpoints import CheckpointSpec, build_tokenizer, corpus_token_ids

SPECS = [CheckpointSpec("olmoe", train_steps=200), CheckpointSpec("qwen2_moe", train_steps=200)]
SEQUENCES, SEQUENCE_TOKENS = 4, 64


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _compare(packs, spec, quant):
    from colibrid.engine import load

    reference, quantized = load(packs.pack(spec, "f32")), load(packs.pack(spec, quant))
    corpus = corpus_token_ids(build_tokenizer(packs.root / "measure-tokenizer"))
    starts = np.random.default_rng(7).integers(0, len(corpus) - SEQUENCE_TOKENS, SEQUENCES)
    agree, kls = [], []
    for start in starts:
        ids = corpus[start : start + SEQUENCE_TOKENS]
        lp_ref, lp_q = _log_softmax(reference.forward(ids)), _log_softmax(quantized.forward(ids))
        agree.append(lp_ref.argmax(-1) == lp_q.argmax(-1))
        kls.append((np.exp(lp_ref) * (lp_ref - lp_q)).sum(-1))
    return float(np.concatenate(agree).mean()), float(np.concatenate(kls).mean())


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.arch)
def test_q8_0_agrees_with_f32(packs, spec):
    top1, kl = _compare(packs, spec, "q8_0")
    print(f"\n{spec.arch} q8_0: top-1 agreement {top1:.4f}, mean KL {kl:.5f} nats")
    assert top1 >= 0.98
    assert 0 <= kl < 0.01


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.arch)
def test_q4_g64_is_measured(packs, spec):
    top1, kl = _compare(packs, spec, "q4_g64")
    print(f"\n{spec.arch} q4_g64: top-1 agreement {top1:.4f}, mean KL {kl:.5f} nats")
    q8_top1, q8_kl = _compare(packs, spec, "q8_0")
    # 4 bits must cost more than 8 but still track the model (a broken kernel gives ~1/V agreement).
    assert kl > q8_kl
    assert top1 >= 0.7


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.arch)
def test_mxfp4_is_measured(packs, spec):
    """mxfp4 for every class (the converter's OCP quantizer; published MXFP4 experts are
    copied instead): a 4.25-bit type, measured like q4_g64."""
    top1, kl = _compare(packs, spec, "mxfp4")
    print(f"\n{spec.arch} mxfp4: top-1 agreement {top1:.4f}, mean KL {kl:.5f} nats")
    q8_top1, q8_kl = _compare(packs, spec, "q8_0")
    assert kl > q8_kl
    assert top1 >= 0.7


def test_mixed_quant_classes(packs):
    """Per-class --quant: experts, dense and embeddings each get their own type."""
    from colibrid.pack import Pack

    spec = SPECS[0]
    manifest = Pack.open(packs.pack(spec, "experts=q4_g64,dense=bf16,embeddings=f16")).manifest
    assert manifest.expert_parts["gate"].type == "q4_g64"
    assert manifest.dense_tensors["layers.0.attn.o"].type == "bf16"
    assert manifest.dense_tensors["embed"].type == "f16"
    assert manifest.dense_tensors["lm_head"].type == "f16"
    assert manifest.dense_tensors["layers.0.attn_norm"].type == "f32"
    top1, _ = _compare(packs, spec, "experts=q4_g64,dense=bf16,embeddings=f16")
    assert top1 >= 0.7
