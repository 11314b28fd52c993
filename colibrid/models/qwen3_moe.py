"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): RMSNorm per head on q and k, explicit
head_dim, no shared expert, decoder_sparse_step / mlp_only_layers."""

from __future__ import annotations

from typing import Any

from colibrid.models.base import Architecture, attention_bias_tensors, common_fields, qwen_moe_fields
from colibrid.models.model_config import ModelConfig


class Qwen3Moe(Architecture):
    name = "qwen3_moe"
    hf_model_types = ("qwen3_moe",)

    def model_config(self, hf: dict[str, Any]) -> ModelConfig:
        fields = common_fields(hf, self.name, default_theta=10000.0)
        layers = fields["num_layers"]
        window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
        return ModelConfig(
            **fields,
            qk_norm="head",
            sliding_window=(window,) * layers,
            **qwen_moe_fields(hf, layers),
        )

    def optional_tensors(self, hf: dict[str, Any]) -> frozenset[str]:
        return attention_bias_tensors(hf)
