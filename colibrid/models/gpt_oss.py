"""gpt-oss (openai/gpt-oss-20b, gpt-oss-120b): GQA with q/k/v/o biases, a learned sink logit
per head, sliding-window and full layers alternating as ``layer_types`` says, YaRN RoPE; a
router with a bias that picks the top-k logits and softmaxes over those only; experts with
biases and a clamped SwiGLU, their gate and up fused in one tensor with the gate on the even
rows and the up on the odd ones.

The experts come in two layouts, both read in place through TensorRef (no fused tensor is
read whole):
  published MXFP4  ``gate_up_proj_blocks`` / ``_scales`` (E, 2F, D / 32, ...): rows are
                   outputs, groups of 32 run along the input, so the gate is every even row
                   (whole blocks: the split is lossless) and ``down_proj`` is (E, D, F);
  value dtypes     ``gate_up_proj`` (E, D, 2F) and ``down_proj`` (E, F, D), as transformers
                   keeps them (x @ W): read transposed.
"""

from __future__ import annotations

from typing import Any

from colibrid.models.tensor_ref import TensorRef
from colibrid.models.base import Architecture, ExpertTensorNames, UnsupportedConfig, common_fields, num_experts, require
from colibrid.models.model_config import ModelConfig

# transformers' GptOssConfig defaults, which the published config.json leaves out
DEFAULT_SWIGLU_ALPHA = 1.702
DEFAULT_SWIGLU_LIMIT = 7.0
LAYER_TYPES = ("sliding_attention", "full_attention")

EVEN_ROWS, ODD_ROWS = slice(0, None, 2), slice(1, None, 2)


def layer_windows(hf: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    """Per layer: the sliding window of a "sliding_attention" layer, None for a full one.
    Without layer_types, transformers alternates them, sliding first."""
    types = hf.get("layer_types") or [LAYER_TYPES[layer % 2] for layer in range(layers)]
    if len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise UnsupportedConfig(f"layer_types must name {layers} layers, each one of {', '.join(LAYER_TYPES)}")
    window = hf.get("sliding_window")
    if "sliding_attention" in types and not (isinstance(window, int) and window >= 1):
        raise UnsupportedConfig(f"sliding_attention layers need a sliding_window >= 1, got {window!r}")
    return tuple(window if t == "sliding_attention" else None for t in types)


class GptOss(Architecture):
    name = "gpt_oss"
    hf_model_types = ("gpt_oss",)
    router_name = "mlp.router"

    def model_config(self, hf: dict[str, Any]) -> ModelConfig:
        fields = common_fields(hf, self.name, default_theta=150000.0)
        if not hf.get("attention_bias", True):
            raise UnsupportedConfig("gpt_oss without attention_bias is not supported")
        layers = fields["num_layers"]
        return ModelConfig(
            **fields,
            sliding_window=layer_windows(hf, layers),
            num_experts=num_experts(hf),
            num_experts_per_tok=require(hf, "num_experts_per_tok"),
            expert_ffn=require(hf, "intermediate_size"),
            moe_layers=(True,) * layers,
            router_scoring="topk_softmax",
            expert_activation="clamped_swiglu",
            swiglu_alpha=float(hf.get("swiglu_alpha", DEFAULT_SWIGLU_ALPHA)),
            swiglu_limit=float(hf.get("swiglu_limit", DEFAULT_SWIGLU_LIMIT)),
        )

    def optional_tensors(self, hf: dict[str, Any]) -> frozenset[str]:
        return frozenset({"qkv_bias", "o_bias", "attention_sinks", "router_bias", "expert_bias"})

    def expert_tensor_names(self, layer: int, expert: int) -> ExpertTensorNames:
        base = f"model.layers.{layer}.{self.experts_prefix}."
        gate_up, down, at = base + "gate_up_proj", base + "down_proj", (expert,)
        return ExpertTensorNames(
            gate=TensorRef(gate_up, at, EVEN_ROWS, transposed=True),
            up=TensorRef(gate_up, at, ODD_ROWS, transposed=True),
            down=TensorRef(down, at, transposed=True),
            gate_bias=TensorRef(gate_up + "_bias", at, EVEN_ROWS),
            up_bias=TensorRef(gate_up + "_bias", at, ODD_ROWS),
            down_bias=TensorRef(down + "_bias", at),
        )
