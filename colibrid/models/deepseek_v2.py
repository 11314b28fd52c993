"""DeepSeek-V2 (deepseek-ai/DeepSeek-V2, DeepSeek-V2-Lite): multi-head latent attention (q
through a low-rank q_a -> norm -> q_b path, or one q_proj when q_lora_rank is null as in
V2-Lite; keys and values from one latent per token, see MlaConfig), RoPE on interleaved
pairs of the rope dims, YaRN whose mscale_all_dim also scales the softmax; softmax routing,
greedy or group_limited_greedy (groups scored by their best expert), the top-k weights
times routed_scaling_factor and never renormalised (transformers' DeepseekV2 router ignores
norm_topk_prob); shared experts; dense MLPs in the first first_k_dense_replace layers."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from colibrid.models.base import Architecture, UnsupportedConfig, common_fields, require
from colibrid.models.model_config import MlaConfig, ModelConfig, RopeConfig

TOPK_METHODS = ("greedy", "group_limited_greedy")


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """The rope settings as transformers 5 reads them: rope_parameters, else rope_scaling."""
    return {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}


def deepseek_rope(hf: dict[str, Any], rope: RopeConfig) -> RopeConfig:
    """YaRN's cos/sin factor as DeepSeek configs ask for it: mscale(factor, mscale) /
    mscale(factor, mscale_all_dim) when both are given (1 for V3 and Kimi K2)."""
    params = rope_parameters(hf)
    if rope.type != "yarn" or rope.attention_factor is not None or not (params.get("mscale") and params.get("mscale_all_dim")):
        return rope
    factor = rope.factor
    return dataclasses.replace(rope, attention_factor=_yarn_mscale(factor, params["mscale"])
                               / _yarn_mscale(factor, params["mscale_all_dim"]))


def mla_config(hf: dict[str, Any], rope: RopeConfig, rope_interleaved: bool) -> MlaConfig:
    nope, rope_dims = int(require(hf, "qk_nope_head_dim")), int(require(hf, "qk_rope_head_dim"))
    scale = (nope + rope_dims) ** -0.5
    mscale_all_dim = rope_parameters(hf).get("mscale_all_dim")
    if rope.type != "default" and mscale_all_dim:  # transformers' yarn_apply_mscale
        scale *= _yarn_mscale(rope.factor, mscale_all_dim) ** 2
    return MlaConfig(kv_lora_rank=int(require(hf, "kv_lora_rank")), qk_nope_head_dim=nope, qk_rope_head_dim=rope_dims,
                     v_head_dim=int(require(hf, "v_head_dim")), softmax_scale=float(scale),
                     q_lora_rank=int(hf.get("q_lora_rank") or 0), rope_interleaved=rope_interleaved)


class DeepseekV2(Architecture):
    name = "deepseek_v2"
    hf_model_types = ("deepseek_v2",)
    shared_expert_prefix = "mlp.shared_experts"

    def rope_interleaved(self, hf: dict[str, Any]) -> bool:
        return True  # V2 rotates complex pairs

    def routing_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        method = hf.get("topk_method") or "greedy"
        if method not in TOPK_METHODS:
            raise UnsupportedConfig(f"{self.name}: topk_method {method!r} is not supported (supported: "
                                    f"{', '.join(TOPK_METHODS)})")
        if (hf.get("scoring_func") or "softmax") != "softmax":
            raise UnsupportedConfig(f"{self.name}: scoring_func {hf['scoring_func']!r} is not supported (only softmax)")
        grouped = method == "group_limited_greedy"
        return dict(norm_topk_prob=False, router_scoring="softmax",
                    router_groups=int(hf.get("n_group") or 1) if grouped else 1,
                    router_groups_kept=int(hf.get("topk_group") or 1) if grouped else 1, router_group_score="max")

    def model_config(self, hf: dict[str, Any]) -> ModelConfig:
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise UnsupportedConfig(f"{self.name}: attention_bias / mlp_bias are not supported (no published model has them)")
        fields = common_fields(hf, self.name, default_theta=10000.0)
        rope = deepseek_rope(hf, fields["rope"])
        mla = mla_config(hf, rope, self.rope_interleaved(hf))
        layers = fields["num_layers"]
        expert_ffn = require(hf, "moe_intermediate_size")
        fields.update(rope=rope, head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim, num_kv_heads=fields["num_heads"])
        return ModelConfig(
            **fields,
            mla=mla,
            sliding_window=(None,) * layers,
            num_experts=require(hf, "n_routed_experts"),
            num_experts_per_tok=require(hf, "num_experts_per_tok"),
            expert_ffn=expert_ffn,
            moe_layers=tuple(layer >= int(hf.get("first_k_dense_replace") or 0) for layer in range(layers)),
            dense_ffn=hf.get("intermediate_size") or 0,
            shared_expert_ffn=expert_ffn * int(hf.get("n_shared_experts") or 0),
            routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
            **self.routing_fields(hf),
        )
