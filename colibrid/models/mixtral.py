"""Mixtral: softmax router, top-k always renormalised, experts named w1/w3/w2,
optional sliding-window attention on every layer."""

from __future__ import annotations

from typing import Any

from colibrid.models.base import Architecture, common_fields, num_experts
from colibrid.models.model_config import ModelConfig


class Mixtral(Architecture):
    name = "mixtral"
    hf_model_types = ("mixtral",)
    router_name = "block_sparse_moe.gate"
    experts_prefix = "block_sparse_moe.experts"
    expert_projections = ("w1", "w3", "w2")  # gate, up, down

    def model_config(self, hf: dict[str, Any]) -> ModelConfig:
        fields = common_fields(hf, self.name, default_theta=1e6)
        return ModelConfig(
            **fields,
            sliding_window=(hf.get("sliding_window"),) * fields["num_layers"],
            num_experts=num_experts(hf),
            num_experts_per_tok=hf["num_experts_per_tok"],
            expert_ffn=hf["intermediate_size"],
            norm_topk_prob=True,
            moe_layers=(True,) * fields["num_layers"],
        )
