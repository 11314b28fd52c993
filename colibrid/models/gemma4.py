"""Gemma 4 with its MoE block (google/gemma-4-26B-A4B-it; model_type gemma4_text, or the text
model of a gemma4 multimodal checkpoint, converted without its vision and audio towers).

Every layer:
  h = x + post_norm(attention(input_norm(x)))
  h + ffn_post_norm(mlp_post_norm(mlp(ffn_norm(h))) + experts_post_norm(experts(experts_norm(h))))
then, with per-layer inputs, + post_per_layer_input_norm(proj(gelu(gate(.)) * per_layer_input)),
and the whole times the layer's scalar. The router scores rms_norm(h) * scale * D^-0.5 with a
softmax over all experts, keeps the top k renormalised, times a learned per-expert scale.
The dense MLP and the experts are GeGLU (gelu_pytorch_tanh).

Attention: sliding and full layers as ``layer_types`` says; q, k and v RMS-normed per head
(v without a weight) and a softmax scale of 1. Full layers have their own head width
(``global_head_dim``), kv heads (``num_global_key_value_heads`` with ``attention_k_eq_v``,
where their values are the k projection before its norm) and RoPE (``rope_parameters``
per layer type: proportional RoPE on the full layers, default on the sliding ones).

Gemma 4's RMSNorm multiplies by its weight as it is (not 1 + weight, as Gemma 2/3 did), so
norms are copied unchanged. Embeddings are scaled by sqrt(D) (the tied head is not), the
per-layer ones by sqrt(P), and the logits soft-capped by ``final_logit_softcapping``.
"""

from __future__ import annotations

import math
from typing import Any

from colibrid.models.base import FusedExpertsArchitecture, UnsupportedConfig, common_fields, require
from colibrid.models.model_config import ModelConfig, RopeConfig

LAYER_TYPES = ("sliding_attention", "full_attention")
ACTIVATION = "gelu_pytorch_tanh"
# transformers' Gemma4TextConfig defaults, which a config.json may leave out
DEFAULT_GLOBAL_HEAD_DIM = 512
DEFAULT_SLIDING_WINDOW = 512
DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


def layer_types(hf: dict[str, Any], layers: int) -> list[str]:
    """As Gemma4TextConfig derives them: five sliding layers to one full by default, and the
    last layer always full."""
    types = list(hf.get("layer_types") or ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                           for i in range(layers)])
    if len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise UnsupportedConfig(f"layer_types must name {layers} layers, each one of {', '.join(LAYER_TYPES)}")
    types[-1] = "full_attention"
    return types


def layer_shapes(hf: dict[str, Any], types: list[str]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(head dim, kv heads) per layer: the full layers take global_head_dim, and with
    attention_k_eq_v num_global_key_value_heads, unless config.json lists per_layer_config
    (what transformers 5.24 saves instead)."""
    head_dim, kv_heads = require(hf, "head_dim"), hf.get("num_key_value_heads") or require(hf, "num_attention_heads")
    overrides = hf.get("per_layer_config")
    if overrides is None:
        full = {"head_dim": hf.get("global_head_dim") or DEFAULT_GLOBAL_HEAD_DIM}
        if hf.get("attention_k_eq_v") and hf.get("num_global_key_value_heads"):
            full["num_key_value_heads"] = hf["num_global_key_value_heads"]
        overrides = {str(i): full for i, t in enumerate(types) if t == "full_attention"}
    if not isinstance(overrides, dict):
        raise UnsupportedConfig("per_layer_config must map layers to their head_dim / num_key_value_heads")
    dims, heads = [], []
    for layer in range(len(types)):
        own = overrides.get(str(layer), overrides.get(layer)) or {}
        unknown = set(own) - {"head_dim", "num_key_value_heads"}
        if unknown:
            raise UnsupportedConfig(f"per_layer_config of layer {layer} sets {sorted(unknown)}: not supported")
        dims.append(int(own.get("head_dim", head_dim)))
        heads.append(int(own.get("num_key_value_heads", kv_heads)))
    return tuple(dims), tuple(heads)


def rope_of(hf: dict[str, Any], layer_type: str) -> RopeConfig:
    params = (hf.get("rope_parameters") or DEFAULT_ROPE).get(layer_type) or DEFAULT_ROPE[layer_type]
    rope_type, theta = params.get("rope_type", "default"), float(params["rope_theta"])
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type == "proportional":
        return RopeConfig(theta=theta, type="proportional", factor=float(params.get("factor", 1.0)),
                          partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)))
    raise UnsupportedConfig(f"rope_parameters[{layer_type!r}] rope_type {rope_type!r} is not supported "
                            "(supported: default, proportional)")


def refuse_unsupported(hf: dict[str, Any]) -> None:
    """Every Gemma4TextConfig switch the engine does not implement, named."""
    if not hf.get("enable_moe_block"):
        raise UnsupportedConfig("enable_moe_block is false: a dense Gemma 4, not an MoE model")
    if hf.get("hidden_activation", ACTIVATION) != ACTIVATION:
        raise UnsupportedConfig(f"hidden_activation {hf['hidden_activation']!r} is not supported (only {ACTIVATION})")
    if hf.get("use_bidirectional_attention") == "all":
        raise UnsupportedConfig("use_bidirectional_attention 'all' (non-causal attention) is not supported")
    if hf.get("attention_bias"):
        raise UnsupportedConfig("attention_bias is not supported (no published Gemma 4 has it)")
    if int(hf.get("num_kv_shared_layers") or 0):
        raise UnsupportedConfig("num_kv_shared_layers > 0 (layers reusing another layer's keys and values) is not "
                                "supported yet (no published Gemma 4 MoE has it)")
    per_layer = int(hf.get("hidden_size_per_layer_input") or 0)
    if per_layer and hf.get("vocab_size_per_layer_input", hf.get("vocab_size")) != hf.get("vocab_size"):
        raise UnsupportedConfig("vocab_size_per_layer_input must equal vocab_size")


class Gemma4(FusedExpertsArchitecture):
    name = "gemma4"
    hf_model_types = ("gemma4_text",)
    router_name = "router.proj"
    experts_prefix = "experts"
    ffn_norm_name = "pre_feedforward_layernorm"

    def model_config(self, hf: dict[str, Any]) -> ModelConfig:
        refuse_unsupported(hf)
        # Gemma names its activation hidden_activation (checked above); the rope comes per layer type below
        fields = common_fields(dict(hf, hidden_act="silu"), self.name, default_theta=10_000.0, partial_rotary=1.0)
        layers, dim = fields["num_layers"], fields["hidden_size"]
        types = layer_types(hf, layers)
        dims, kv_heads = layer_shapes(hf, types)
        window = int(hf.get("sliding_window") or DEFAULT_SLIDING_WINDOW)
        fields.update(rope=rope_of(hf, "sliding_attention"), head_dim=dims[0], num_kv_heads=kv_heads[0], rotary_dim=0,
                      tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)))
        softcap = hf.get("final_logit_softcapping")
        return ModelConfig(
            **fields,
            hidden_act=ACTIVATION,
            qk_norm="head",
            sliding_window=tuple(window if t == "sliding_attention" else None for t in types),
            layer_head_dim=dims if len(set(dims)) > 1 else (),
            layer_kv_heads=kv_heads if len(set(kv_heads)) > 1 else (),
            full_attention_rope=rope_of(hf, "full_attention") if "full_attention" in types else None,
            values_from_keys=bool(hf.get("attention_k_eq_v", False)),
            attention_scale=1.0,
            v_norm=True,
            num_experts=require(hf, "num_experts"),
            num_experts_per_tok=require(hf, "top_k_experts"),
            expert_ffn=require(hf, "moe_intermediate_size"),
            norm_topk_prob=True,
            moe_layers=(True,) * layers,
            dense_ffn=require(hf, "intermediate_size"),
            dense_mlp_with_experts=True,
            expert_activation="geglu_tanh",
            embed_scale=math.sqrt(dim),
            final_logit_softcap=float(softcap or 0.0),
            per_layer_input=int(hf.get("hidden_size_per_layer_input") or 0),
        )

    def optional_tensors(self, hf: dict[str, Any]) -> frozenset[str]:
        """The sandwich norms, the router's own norm and per-expert scale, the layer scalar."""
        return frozenset({"post_norms", "router_input_norm", "router_expert_scale", "layer_scalar"})

    def conversion_notes(self, hf: dict[str, Any]) -> list[str]:
        notes = []
        if hf.get("use_bidirectional_attention") == "vision":
            notes.append(f"{self.name}: use_bidirectional_attention 'vision' only changes image tokens, which a text "
                         "pack never sees: text attention stays causal")
        return notes
