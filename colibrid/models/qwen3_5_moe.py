"""Qwen3.5-MoE / Qwen3.6 (Qwen/Qwen3.6-35B-A3B, Qwen3.5-122B-A10B, Qwen3.5-397B-A17B): a hybrid
of Gated DeltaNet layers ("linear_attention") and gated full-attention layers, typically three
to one as ``layer_types`` says; every layer routes over its experts (softmax, top-k,
always renormalised) with a shared expert scaled by a sigmoid gate.

Full-attention layers: q_proj gives each head's query and an output gate (Hd rows each, per
head), the attention output is multiplied by sigmoid(gate) before o_proj; RMSNorm per head on
q and k; RoPE on the leading partial_rotary_factor of each head (0.25 by default). Their RoPE is
Qwen's mRoPE, whose three sections (time, height, width) all see the same position for text:
plain RoPE on the rotated dims.

Every RMSNorm but the DeltaNet's gated one is zero-centred (scales by 1 + w, in float32): the
converter stores 1 + w, so the engine's plain RMSNorm computes the same float32 product.

The published checkpoints are multimodal (model_type qwen3_5_moe: a text_config, the text
model under ``model.language_model.``, a vision tower; colibrid/tools/convert/wrapped.py reads the
text model and leaves the vision tower out). The multi-token-prediction weights (``mtp.*``)
are not converted. Routed experts may be stored one tensor per expert and projection, or fused
per layer (``mlp.experts.gate_up_proj`` (E, 2F, D), gate rows first, and ``down_proj`` (E, D, F)).
"""

from __future__ import annotations

from typing import Any

from colibrid.models.tensor_ref import TensorRef
from colibrid.models.base import FusedExpertsArchitecture, UnsupportedConfig, common_fields, num_experts, require
from colibrid.models.model_config import DeltaNetConfig, ModelConfig

# transformers' Qwen3_5MoeTextConfig / Qwen3NextConfig defaults, for keys config.json leaves out
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25
DEFAULT_FULL_ATTENTION_INTERVAL = 4
DELTANET_DEFAULTS = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                     "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
LAYER_TYPES = {"linear_attention": "deltanet", "full_attention": "attention"}


def layer_mixers(hf: dict[str, Any], layers: int) -> tuple[str, ...]:
    """Per layer "deltanet" or "attention", from layer_types; without them, as transformers
    fills them in: every full_attention_interval-th layer full attention, the others linear."""
    interval = int(hf.get("full_attention_interval") or DEFAULT_FULL_ATTENTION_INTERVAL)
    types = hf.get("layer_types") or ["full_attention" if (layer + 1) % interval == 0 else "linear_attention"
                                      for layer in range(layers)]
    if len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise UnsupportedConfig(f"layer_types must name {layers} layers, each one of {', '.join(LAYER_TYPES)}")
    return tuple(LAYER_TYPES[t] for t in types)


def deltanet_config(hf: dict[str, Any]) -> DeltaNetConfig:
    value = {key: int(hf.get(key) or default) for key, default in DELTANET_DEFAULTS.items()}
    if value["linear_num_value_heads"] % value["linear_num_key_heads"]:
        raise UnsupportedConfig(f"linear_num_value_heads {value['linear_num_value_heads']} is not a multiple of "
                                f"linear_num_key_heads {value['linear_num_key_heads']}")
    return DeltaNetConfig(num_key_heads=value["linear_num_key_heads"], num_value_heads=value["linear_num_value_heads"],
                          key_head_dim=value["linear_key_head_dim"], value_head_dim=value["linear_value_head_dim"],
                          conv_kernel=value["linear_conv_kernel_dim"])


def mtp_layers(hf: dict[str, Any]) -> int:
    return int(hf.get("mtp_num_hidden_layers") or hf.get("num_nextn_predict_layers") or 0)


class Qwen35Moe(FusedExpertsArchitecture):
    name = "qwen3_5_moe"
    # The text model's type: the published multimodal config (qwen3_5_moe) wraps it.
    hf_model_types = ("qwen3_5_moe_text",)
    experts_always_fused = False  # published checkpoints fuse them, others not: for_checkpoint looks

    def moe_fields(self, hf: dict[str, Any], layers: int) -> dict[str, Any]:
        """Every layer routes; the router always renormalises its top-k (no norm_topk_prob)."""
        return dict(num_experts=num_experts(hf), num_experts_per_tok=require(hf, "num_experts_per_tok"),
                    expert_ffn=require(hf, "moe_intermediate_size"), norm_topk_prob=True, moe_layers=(True,) * layers)

    def model_config(self, hf: dict[str, Any]) -> ModelConfig:
        if hf.get("attention_bias"):
            raise UnsupportedConfig(f"{self.name}: attention_bias is not supported (no published model has it)")
        fields = common_fields(hf, self.name, default_theta=10000.0, partial_rotary=DEFAULT_PARTIAL_ROTARY_FACTOR)
        layers = fields["num_layers"]
        mixers = layer_mixers(hf, layers)
        shared_ffn = int(hf.get("shared_expert_intermediate_size") or 0)
        return ModelConfig(
            **fields,
            qk_norm="head",
            layer_mixers=mixers,
            deltanet=deltanet_config(hf) if "deltanet" in mixers else None,
            sliding_window=(None,) * layers,
            **self.moe_fields(hf, layers),
            shared_expert_ffn=shared_ffn,
        )

    def optional_tensors(self, hf: dict[str, Any]) -> frozenset[str]:
        """The attention layers' output gate (in q_proj); the shared expert's sigmoid gate."""
        shared = {"shared_expert_gated"} if hf.get("shared_expert_intermediate_size") else set()
        return frozenset({"attention_output_gate"} | shared)

    def zero_centred_norms(self, config: ModelConfig) -> list[str]:
        names = ["final_norm"]
        for layer in range(config.num_layers):
            names += [f"layers.{layer}.attn_norm", f"layers.{layer}.ffn_norm"]
            if config.layer_mixer(layer) == "attention":
                names += [f"layers.{layer}.attn.q_norm", f"layers.{layer}.attn.k_norm"]
        return names

    def deltanet_tensor_names(self, config: ModelConfig, layer: int) -> dict[str, "str | TensorRef"]:
        names = super().deltanet_tensor_names(config, layer)
        d = config.deltanet
        conv = names[f"layers.{layer}.attn.conv"]  # (C, 1, Kc): a depthwise conv's weight
        names[f"layers.{layer}.attn.conv"] = TensorRef(conv, view=(d.conv_channels, d.conv_kernel))
        return names

    def conversion_notes(self, hf: dict[str, Any]) -> list[str]:
        count = mtp_layers(hf)
        return [f"{self.name}: skipping the {count} multi-token-prediction layer(s) (mtp.*): Colibri predicts "
                "one token per step"] if count else []
