"""Llama 4 (meta-llama/Llama-4-Scout-17B-16E-Instruct, Llama-4-Maverick-17B-128E-Instruct):
the text model of Llama4ForConditionalGeneration (model_type llama4, its text_config
llama4_text; converted through the multimodal wrapper, the vision tower left out).

- MoE layers where ``moe_layers`` says (else every ``interleave_moe_layer_step``-th layer),
  dense MLPs of width ``intermediate_size_mlp`` on the others.
- Routing: the top-k logits (k = 1 as published), then the sigmoid of each; the weight scales
  the expert's INPUT and the expert's output is added unweighted; plus an ungated shared expert.
- RoPE on complex (interleaved) pairs, optionally with Llama 3's frequency scaling; NoPE
  layers (``no_rope_layers``: 0 = no RoPE) skip it and get attention temperature tuning
  (``attn_temperature_tuning``, ``floor_scale``, ``attn_scale``); the layers with RoPE
  RMS-normalise each q/k head without a weight after RoPE (``use_qk_norm``).
- Chunked local attention (``attention_chunk_size``) on ``chunked_attention`` layers (by
  default the layers with RoPE), full attention on the others.
- The experts are fused: ``gate_up_proj`` (E, D, 2F), gate first, and ``down_proj`` (E, F, D),
  kept as transformers multiplies them (x @ W), read transposed through TensorRef.
"""

from __future__ import annotations

from typing import Any

from colibrid.models.base import (FusedExpertsArchitecture, UnsupportedConfig, attention_bias_tensors, common_fields,
                                  num_experts, require)
from colibrid.models.model_config import ModelConfig

DEFAULT_THETA = 500000.0  # transformers' Llama4TextConfig.default_theta
DEFAULT_NO_ROPE_LAYER_INTERVAL = 4  # transformers' default: every 4th layer is a NoPE layer
DEFAULT_FLOOR_SCALE, DEFAULT_ATTN_SCALE = 8192, 0.1
LAYER_TYPES = ("chunked_attention", "full_attention")


def moe_layer_flags(hf: dict[str, Any], layers: int) -> tuple[bool, ...]:
    """``moe_layers`` (layer ids) when given, else every interleave_moe_layer_step-th layer
    (step - 1, 2 * step - 1 ...), as transformers fills it in."""
    ids = hf.get("moe_layers")
    if ids is None:
        step = int(hf.get("interleave_moe_layer_step") or 1)
        ids = range(step - 1, layers, step)
    ids = set(ids)
    if not all(isinstance(i, int) and 0 <= i < layers for i in ids):
        raise UnsupportedConfig(f"moe_layers must name layers 0..{layers - 1}")
    return tuple(layer in ids for layer in range(layers))


def nope_layer_flags(hf: dict[str, Any], layers: int) -> tuple[bool, ...]:
    """Per layer, True for a NoPE layer: ``no_rope_layers`` holds 1 for a layer WITH RoPE and
    0 for one without (transformers' naming); absent or empty, every
    no_rope_layer_interval-th layer has none."""
    flags = hf.get("no_rope_layers")
    if not flags:
        interval = int(hf.get("no_rope_layer_interval") or DEFAULT_NO_ROPE_LAYER_INTERVAL)
        return tuple((layer + 1) % interval == 0 for layer in range(layers))
    if len(flags) < layers or any(f not in (0, 1) for f in flags[:layers]):
        raise UnsupportedConfig(f"no_rope_layers must hold 0 or 1 for each of the {layers} layers")
    return tuple(not flags[layer] for layer in range(layers))


def layer_chunks(hf: dict[str, Any], nope: tuple[bool, ...]) -> tuple[int | None, ...]:
    """Per layer, the chunk of a ``chunked_attention`` layer (attention_chunk_size), None for a
    full one; ``layer_types`` when given, else chunked where RoPE is when attention_chunk_size
    is set (transformers' default); () when no layer is chunked."""
    chunk, types = hf.get("attention_chunk_size"), hf.get("layer_types")
    if types is None:
        types = ["chunked_attention" if chunk is not None and not is_nope else "full_attention" for is_nope in nope]
    if len(types) != len(nope) or any(t not in LAYER_TYPES for t in types):
        raise UnsupportedConfig(f"layer_types must name {len(nope)} layers, each one of {', '.join(LAYER_TYPES)}")
    if "chunked_attention" not in types:
        return ()
    if not (isinstance(chunk, int) and chunk >= 1):
        raise UnsupportedConfig(f"chunked_attention layers need an attention_chunk_size >= 1, got {chunk!r}")
    return tuple(chunk if t == "chunked_attention" else None for t in types)


class Llama4(FusedExpertsArchitecture):
    name = "llama4"
    hf_model_types = ("llama4_text",)  # "llama4" is the multimodal wrapper, read through its text_config
    router_name = "feed_forward.router"
    shared_expert_prefix = "feed_forward.shared_expert"
    experts_prefix = "feed_forward.experts"
    dense_mlp_prefix = "feed_forward"
    experts_transposed = True  # gate_up_proj (E, D, 2F), down_proj (E, F, D)

    def model_config(self, hf: dict[str, Any]) -> ModelConfig:
        fields = common_fields(hf, self.name, default_theta=DEFAULT_THETA)
        layers = fields["num_layers"]
        nope = nope_layer_flags(hf, layers)
        temperature = bool(hf.get("attn_temperature_tuning", True)) and any(nope)
        expert_ffn = require(hf, "intermediate_size")
        moe = moe_layer_flags(hf, layers)
        return ModelConfig(
            **fields,
            qk_norm="l2" if hf.get("use_qk_norm", True) else "none",
            sliding_window=(None,) * layers,
            attention_chunk=layer_chunks(hf, nope),
            rope_interleaved=True,
            nope_layers=nope,
            attn_temperature_floor=int(hf.get("floor_scale") or DEFAULT_FLOOR_SCALE) if temperature else 0,
            attn_temperature_scale=float(hf.get("attn_scale", DEFAULT_ATTN_SCALE)) if temperature else 0.0,
            num_experts=num_experts(hf),
            num_experts_per_tok=int(hf.get("num_experts_per_tok") or 1),
            expert_ffn=expert_ffn,
            moe_layers=moe,
            dense_ffn=int(require(hf, "intermediate_size_mlp")) if not all(moe) else 0,
            shared_expert_ffn=expert_ffn,
            router_scoring="topk_sigmoid",
            router_weight_on_input=True,
        )

    def optional_tensors(self, hf: dict[str, Any]) -> frozenset[str]:
        return attention_bias_tensors(hf)

