"""OLMoE (allenai/OLMoE-1B-7B): softmax router without renormalisation by default,
RMSNorm over the whole q and k projections, optional clip_qkv, no shared experts."""

from __future__ import annotations

from typing import Any

from colibrid.models.base import Architecture, attention_bias_tensors, common_fields, num_experts
from colibrid.models.model_config import ModelConfig


class Olmoe(Architecture):
    name = "olmoe"
    hf_model_types = ("olmoe",)

    def model_config(self, hf: dict[str, Any]) -> ModelConfig:
        fields = common_fields(hf, self.name, default_theta=10000.0)
        return ModelConfig(
            **fields,
            qk_norm="full",
            clip_qkv=hf.get("clip_qkv"),
            sliding_window=(None,) * fields["num_layers"],
            num_experts=num_experts(hf),
            num_experts_per_tok=hf["num_experts_per_tok"],
            expert_ffn=hf["intermediate_size"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            moe_layers=(True,) * fields["num_layers"],
        )

    def optional_tensors(self, hf: dict[str, Any]) -> frozenset[str]:
        return attention_bias_tensors(hf)
