"""Each architecture is the same model as transformers' implementation: with an f32
pack, logits match at every position of a 32-token prompt and 32 greedy tokens are
identical. The specs cover shared experts, GQA, norm_topk_prob both ways,
decoder_sparse_step / mlp_only_layers, tied and untied heads, sliding windows,
a sharded checkpoint and a bf16 source."""

from __future__ import annotations

import pytest

from tests.tiny_checkpoints import CheckpointSpec, assert_same_model, load_reference, random_prompt

SPECS = [
    CheckpointSpec("olmoe"),
    CheckpointSpec("olmoe", {"norm_topk_prob": True, "tie_word_embeddings": True}, max_shard_size="60KB"),
    CheckpointSpec("mixtral", {"sliding_window": 12}),
    CheckpointSpec("mixtral", {"num_key_value_heads": 1}, dtype="bfloat16"),
    CheckpointSpec("qwen2_moe", {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}),
    CheckpointSpec("qwen2_moe", {"norm_topk_prob": True, "use_sliding_window": True, "sliding_window": 10,
                                 "max_window_layers": 2, "tie_word_embeddings": True}),
    CheckpointSpec("qwen3_moe", {"head_dim": 32, "norm_topk_prob": True, "mlp_only_layers": [0]}),
    CheckpointSpec("qwen3_moe", {"num_hidden_layers": 3, "decoder_sparse_step": 2, "tie_word_embeddings": True,
                                 "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_logits_and_greedy_match_transformers(spec, packs):
    from colibrid.engine import load

    engine = load(packs.pack(spec, "f32"))
    assert_same_model(load_reference(packs.checkpoint(spec)), engine, random_prompt(engine.config.vocab_size))


def test_specs_exercise_the_features_they_claim(packs):
    """Guards the coverage list above against silently testing less than it says."""
    from colibrid.pack import Pack

    manifests = [Pack.open(packs.pack(spec, "f32")).manifest for spec in SPECS]
    configs = [m.model for m in manifests]
    assert {c.architecture for c in configs} == {"olmoe", "mixtral", "qwen2_moe", "qwen3_moe"}
    assert any(m.model.shared_expert_ffn and "shared_expert_gated" in m.optional_tensors for m in manifests)
    assert any(c.num_kv_heads < c.num_heads for c in configs)
    assert {c.norm_topk_prob for c in configs} == {True, False}
    assert any(not all(c.moe_layers) for c in configs)
    assert {c.tie_word_embeddings for c in configs} == {True, False}
    assert any(any(w for w in c.sliding_window) for c in configs)
    assert any(c.qk_norm == "full" for c in configs) and any(c.qk_norm == "head" for c in configs)
    assert any(c.rope.type == "linear" for c in configs)
    sharded = [s for s in SPECS if s.max_shard_size]
    assert sharded and all(len(list(packs.checkpoint(s).glob("model-*-of-*.safetensors"))) > 1 for s in sharded)
    assert any(s.dtype == "bfloat16" for s in SPECS)
