"""Architecture modules read both the transformers-5 config.json layout written by the
test checkpoints and the older layout most published checkpoints still carry."""

from __future__ import annotations

import pytest

from colibrid.models import UnsupportedArchitecture, UnsupportedConfig, architecture_for

QWEN15_MOE_STYLE = {  # the shape of Qwen1.5-MoE-A2.7B's config.json (smaller numbers)
    "model_type": "qwen2_moe", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "num_experts": 8, "num_experts_per_tok": 4, "moe_intermediate_size": 32, "intermediate_size": 128,
    "shared_expert_intermediate_size": 128, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 21, "eos_token_id": 7,
}


def test_legacy_qwen2_moe_config():
    arch = architecture_for(QWEN15_MOE_STYLE)
    config, optional = arch.model_config(QWEN15_MOE_STYLE), arch.optional_tensors(QWEN15_MOE_STYLE)
    assert config.rope.theta == 1e6 and config.rope.type == "default"
    # Qwen2 has q/k/v biases unless told otherwise, none on o; a gated shared expert
    assert optional == {"qkv_bias", "shared_expert_gated"} and config.shared_expert_ffn == 128
    assert arch.optional_tensors(dict(QWEN15_MOE_STYLE, qkv_bias=False)) == {"shared_expert_gated"}
    assert config.sliding_window == (None,) * 4  # use_sliding_window false wins over sliding_window
    assert config.moe_layers == (True,) * 4 and config.eos_token_ids == (7,)


def test_legacy_rope_scaling_linear():
    hf = dict(QWEN15_MOE_STYLE, rope_scaling={"type": "linear", "factor": 4.0})
    rope = architecture_for(hf).model_config(hf).rope
    assert (rope.type, rope.factor, rope.theta) == ("linear", 4.0, 1e6)


def test_unsupported_rope_type_is_named():
    hf = dict(QWEN15_MOE_STYLE, rope_scaling={"rope_type": "longrope", "factor": 4.0})
    with pytest.raises(UnsupportedConfig, match="rope type 'longrope' is not supported"):
        architecture_for(hf).model_config(hf)


def test_mixtral_counts_experts_as_local_experts():
    hf = {"model_type": "mixtral", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2,
          "intermediate_size": 64, "sliding_window": None, "rope_theta": 1e6}
    config = architecture_for(hf).model_config(hf)
    assert config.num_experts == 8 and config.norm_topk_prob and config.num_kv_heads == 2


def test_unknown_architecture_lists_supported():
    with pytest.raises(UnsupportedArchitecture, match="supported: deepseek_v2, deepseek_v3, gemma4, glm4_moe, gpt_oss, llama4, mixtral, olmoe, qwen2_moe, qwen3_5_moe, qwen3_moe, qwen3_next"):
        architecture_for({"model_type": "llama"})
