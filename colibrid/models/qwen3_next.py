"""Qwen3-Next (Qwen/Qwen3-Next-80B-A3B-Instruct, -Thinking): the design Qwen3.5-MoE grew from
(see qwen3_5_moe.py): Gated DeltaNet and gated full-attention layers, zero-centred RMSNorms,
a sigmoid-gated shared expert. It differs in:
  - one text checkpoint, not a multimodal wrapper;
  - the DeltaNet input projections are fused per key-head group: ``in_proj_qkvz`` holds, for
    each of the Hk groups, q (Dk rows), k (Dk), v (r * Dv), z (r * Dv) with r = Hv / Hk, and
    ``in_proj_ba`` b (r), a (r) per group. The converter gathers their rows into the pack's
    qkv = [every q | every k | every v], z, b and a (transformers' fix_query_key_value_ordering);
  - norm_topk_prob, decoder_sparse_step and mlp_only_layers as Qwen2/3-MoE (dense MLPs where
    those say so).
"""

from __future__ import annotations

from typing import Any

from colibrid.models.tensor_ref import TensorRef
from colibrid.models.base import num_experts, require, sparse_layer_flags
from colibrid.models.model_config import ModelConfig
from colibrid.models.qwen3_5_moe import Qwen35Moe


def fused_projection_rows(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Row numbers of in_proj_qkvz ("qkv", "z") and in_proj_ba ("b", "a") that make the pack's
    tensors, in the pack's order."""
    d = config.deltanet
    Hk, Dk, Dv = d.num_key_heads, d.key_head_dim, d.value_head_dim
    r = d.num_value_heads // Hk  # value heads per key head
    group = 2 * Dk + 2 * r * Dv  # rows of one key-head group in in_proj_qkvz: q | k | v | z

    def take(offset: int, width: int) -> tuple[int, ...]:
        return tuple(g * group + offset + i for g in range(Hk) for i in range(width))

    q, k, v, z = take(0, Dk), take(Dk, Dk), take(2 * Dk, r * Dv), take(2 * Dk + r * Dv, r * Dv)
    b = tuple(g * 2 * r + i for g in range(Hk) for i in range(r))
    return {"qkv": q + k + v, "z": z, "b": b, "a": tuple(row + r for row in b)}


class Qwen3Next(Qwen35Moe):
    name = "qwen3_next"
    hf_model_types = ("qwen3_next",)

    def moe_fields(self, hf: dict[str, Any], layers: int) -> dict[str, Any]:
        return dict(num_experts=num_experts(hf), num_experts_per_tok=require(hf, "num_experts_per_tok"),
                    expert_ffn=require(hf, "moe_intermediate_size"), norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                    moe_layers=sparse_layer_flags(hf, layers), dense_ffn=hf.get("intermediate_size") or 0)

    def deltanet_tensor_names(self, config: ModelConfig, layer: int) -> dict[str, "str | TensorRef"]:
        names = super().deltanet_tensor_names(config, layer)
        hf, pk = f"model.layers.{layer}.linear_attn.", f"layers.{layer}.attn."
        rows = fused_projection_rows(config)
        for part, fused in (("qkv", "in_proj_qkvz"), ("z", "in_proj_qkvz"), ("b", "in_proj_ba"), ("a", "in_proj_ba")):
            names[pk + part] = TensorRef(f"{hf}{fused}.weight", rows=rows[part])
        return names
