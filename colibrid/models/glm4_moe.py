"""GLM-4.5 / GLM-4.6 (zai-org/GLM-4.5-Air, GLM-4.5, GLM-4.6): DeepSeek-V3-style routing
(sigmoid scores, a choice-only e_score_correction_bias, group-limited choice, a scaling
factor), an ungated shared expert, dense MLPs in the first first_k_dense_replace layers,
GQA with partial rotary (the leading half of each head by default), optional per-head
q/k RMSNorm and q/k/v biases. The multi-token-prediction layers published after the
last decoder layer are not converted."""

from __future__ import annotations

from typing import Any

from colibrid.models.base import Architecture, attention_bias_tensors, common_fields, require
from colibrid.models.model_config import ModelConfig

# transformers' Glm4MoeConfig fills partial_rotary_factor in when config.json has none
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5


def mtp_layers(hf: dict[str, Any]) -> int:
    return int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or 0)


class Glm4Moe(Architecture):
    name = "glm4_moe"
    hf_model_types = ("glm4_moe",)
    shared_expert_prefix = "mlp.shared_experts"

    def model_config(self, hf: dict[str, Any]) -> ModelConfig:
        fields = common_fields(hf, self.name, default_theta=10000.0, partial_rotary=DEFAULT_PARTIAL_ROTARY_FACTOR)
        layers = fields["num_layers"]
        first_moe_layer = int(hf.get("first_k_dense_replace", 1))
        expert_ffn = require(hf, "moe_intermediate_size")
        return ModelConfig(
            **fields,
            qk_norm="head" if hf.get("use_qk_norm", False) else "none",
            sliding_window=(None,) * layers,
            num_experts=require(hf, "n_routed_experts"),
            num_experts_per_tok=require(hf, "num_experts_per_tok"),
            expert_ffn=expert_ffn,
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            moe_layers=tuple(layer >= first_moe_layer for layer in range(layers)),
            dense_ffn=hf.get("intermediate_size") or 0,
            shared_expert_ffn=expert_ffn * int(hf.get("n_shared_experts", 1) or 0),
            router_scoring="sigmoid",
            router_groups=int(hf.get("n_group") or 1),
            router_groups_kept=int(hf.get("topk_group") or 1),
            router_group_score="top2_sum",
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        )

    def optional_tensors(self, hf: dict[str, Any]) -> frozenset[str]:
        """The routers' choice bias (e_score_correction_bias); q/k/v biases with attention_bias
        (o_proj never has one)."""
        return attention_bias_tensors(hf, o_bias=False) | {"router_choice_bias"}

    def conversion_notes(self, hf: dict[str, Any]) -> list[str]:
        count = mtp_layers(hf)
        if not count:
            return []
        first = require(hf, "num_hidden_layers")
        return [f"{self.name}: skipping {count} multi-token-prediction layer(s) (model.layers.{first}"
                f"{f'..{first + count - 1}' if count > 1 else ''}): Colibri predicts one token per step"]
