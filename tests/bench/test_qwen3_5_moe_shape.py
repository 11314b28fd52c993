"""bench/shapes/qwen3_5_moe.py: the random checkpoint is the one transformers' Qwen3.5-MoE text
model has (every tensor, no other, same shapes), and the GGUF's value-head order is llama.cpp's."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from shapes import qwen3_5_moe  # noqa: E402

SMALL = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32, vocab_size=100)


def test_checkpoint_tensors_are_transformers_qwen3_5_moe_text_model():
    transformers = pytest.importorskip("transformers")
    config = qwen3_5_moe.hf_config(4) | SMALL
    tensors = qwen3_5_moe.checkpoint_tensors(config)
    hf_config = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**hf_config))
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert {name: spec.shape for name, spec in tensors.items()} == expected


def test_value_heads_go_from_grouped_to_tiled():
    # 2 key heads with 3 value heads each, head dim 2: grouped K0v0 K0v1 K0v2 K1v0 K1v1 K1v2
    grouped = np.arange(12)
    tiled = qwen3_5_moe.tiled_value_heads(grouped, 0, key_heads=2, head_dim=2)
    assert tiled.tolist() == [0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11]  # K0v0 K1v0 K0v1 K1v1 K0v2 K1v2
    columns = qwen3_5_moe.tiled_value_heads(np.stack([grouped, grouped + 100]), 1, key_heads=2, head_dim=2)
    assert columns[1].tolist() == (tiled + 100).tolist()
