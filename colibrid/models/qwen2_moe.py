"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): biased q/k/v, a shared expert scaled by a
sigmoid gate, decoder_sparse_step / mlp_only_layers, per-layer sliding windows."""

from __future__ import annotations

from typing import Any

from colibrid.models.base import Architecture, common_fields, qwen_moe_fields
from colibrid.models.model_config import ModelConfig


def _layer_windows(hf: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    # transformers derives layer_types when config.json does not list them.
    layer_types = hf.get("layer_types")
    if layer_types is None:
        use = bool(hf.get("use_sliding_window", False))
        max_window_layers = hf.get("max_window_layers", 28)
        layer_types = [
            "sliding_attention" if use and (i + 1) % 2 and i < max_window_layers else "full_attention"
            for i in range(num_layers)
        ]
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    return tuple(window if kind == "sliding_attention" and window else None for kind in layer_types)


class Qwen2Moe(Architecture):
    name = "qwen2_moe"
    hf_model_types = ("qwen2_moe",)

    def model_config(self, hf: dict[str, Any]) -> ModelConfig:
        fields = common_fields(hf, self.name, default_theta=10000.0)
        layers = fields["num_layers"]
        return ModelConfig(
            **fields,
            sliding_window=_layer_windows(hf, layers),
            **qwen_moe_fields(hf, layers),
            shared_expert_ffn=hf.get("shared_expert_intermediate_size") or 0,
        )

    def optional_tensors(self, hf: dict[str, Any]) -> frozenset[str]:
        """q/k/v biases unless config.json says qkv_bias false; the shared expert's gate."""
        names = {"qkv_bias"} if hf.get("qkv_bias", True) else set()
        return frozenset(names | ({"shared_expert_gated"} if hf.get("shared_expert_intermediate_size") else set()))
