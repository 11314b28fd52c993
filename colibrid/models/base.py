"""What an architecture module provides, and the Hugging Face config readers they share.

An architecture is described at conversion time only: how to read its ``config.json``
into a :class:`ModelConfig` and the optional tensors its checkpoint holds, and where each
tensor lives in its checkpoint. The pack stores tensors under architecture-neutral names
(listed in ``docs/format.md``), so the engine runs every architecture through the same code.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

from colibrid.models.model_config import ModelConfig, RopeConfig
from colibrid.models.optional_tensors import check_names
from colibrid.models.tensor_ref import TensorRef


class UnsupportedConfig(ValueError):
    """The checkpoint's config uses a feature Colibri does not implement."""


@dataclass(frozen=True)
class ExpertTensorNames:
    """Checkpoint names (or parts of fused tensors) of one routed expert's three projections,
    and of their biases when the model has them (the optional tensors' expert_bias)."""

    gate: "str | TensorRef"  # (F, D)
    up: "str | TensorRef"  # (F, D)
    down: "str | TensorRef"  # (D, F)
    gate_bias: "str | TensorRef | None" = None  # (F)
    up_bias: "str | TensorRef | None" = None  # (F)
    down_bias: "str | TensorRef | None" = None  # (D)


def fused_gate_up_names(experts_prefix: str, expert: int, ffn: int, transposed: bool = False) -> ExpertTensorNames:
    """One expert's parts of its layer's fused ``{experts_prefix}.gate_up_proj`` (E, 2F, D), the
    gate's F rows first, and ``down_proj`` (E, D, F); ``transposed``: stored as transformers
    multiplies them, x @ W, gate_up (E, D, 2F) and down (E, F, D) (Llama 4)."""
    gate_up, down, at = experts_prefix + ".gate_up_proj", experts_prefix + ".down_proj", (expert,)
    return ExpertTensorNames(gate=TensorRef(gate_up, at, slice(0, ffn), transposed=transposed),
                             up=TensorRef(gate_up, at, slice(ffn, 2 * ffn), transposed=transposed),
                             down=TensorRef(down, at, transposed=transposed))


class Architecture:
    """Base class: Llama-style tensor naming shared by every supported MoE family."""

    name: str = ""
    hf_model_types: tuple[str, ...] = ()
    router_name = "mlp.gate"  # under model.layers.{l}.
    router_choice_bias_name = "e_score_correction_bias"  # under the router, with router_choice_bias
    router_bias_name = "bias"  # under the router, with router_bias
    attention_sinks_name = "self_attn.sinks"  # under model.layers.{l}., with attention_sinks
    shared_expert_prefix = "mlp.shared_expert"  # under model.layers.{l}.
    experts_prefix = "mlp.experts"  # under model.layers.{l}.
    dense_mlp_prefix = "mlp"  # under model.layers.{l}., a dense layer's gate_proj / up_proj / down_proj
    expert_projections = ("gate_proj", "up_proj", "down_proj")  # gate, up, down
    ffn_norm_name = "post_attention_layernorm"  # under model.layers.{l}.: the norm before the FFN

    def model_config(self, hf: dict[str, Any]) -> ModelConfig:
        raise NotImplementedError

    def optional_tensors(self, hf: dict[str, Any]) -> frozenset[str]:
        """Which optional tensors (colibrid/models/optional_tensors.py) a checkpoint of this
        family with this config.json holds: the converter reads them, and refuses a checkpoint
        that lacks one of them."""
        return frozenset()

    def for_checkpoint(self, config: ModelConfig, has_tensor: Callable[[str], bool]) -> "Architecture":
        """This architecture as the checkpoint at hand lays it out (a family published in two
        layouts returns the variant that names the tensors ``has_tensor`` finds)."""
        return self

    def conversion_notes(self, hf: dict[str, Any]) -> list[str]:
        """What the converter leaves out of the pack on purpose (logged, one line each)."""
        return []

    def expert_tensor_names(self, layer: int, expert: int) -> ExpertTensorNames:
        base = f"model.layers.{layer}.{self.experts_prefix}.{expert}"
        gate, up, down = self.expert_projections
        return ExpertTensorNames(f"{base}.{gate}.weight", f"{base}.{up}.weight", f"{base}.{down}.weight")

    def dense_tensor_names(self, config: ModelConfig, optional: frozenset[str]) -> dict[str, str]:
        """Pack name -> checkpoint name for every non-routed tensor of the model that has the
        ``optional`` tensors (names of colibrid/models/optional_tensors.py)."""
        optional = check_names(optional)
        names = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight"}
        if not config.tie_word_embeddings:
            names["lm_head"] = "lm_head.weight"
        if config.per_layer_input:  # Gemma's per-layer input embeddings, all layers in one table
            names.update(per_layer_embed="model.embed_tokens_per_layer.weight",
                         per_layer_model_proj="model.per_layer_model_projection.weight",
                         per_layer_proj_norm="model.per_layer_projection_norm.weight")
        for layer in range(config.num_layers):
            names.update(self.layer_tensor_names(config, layer, optional))
        return names

    def layer_tensor_names(self, config: ModelConfig, layer: int, optional: frozenset[str]) -> dict[str, str]:
        hf, pk = f"model.layers.{layer}.", f"layers.{layer}."
        names = {
            pk + "attn_norm": hf + "input_layernorm.weight",
            pk + "ffn_norm": hf + f"{self.ffn_norm_name}.weight",
        }
        attention = config.layer_mixer(layer) == "attention"  # else Gated DeltaNet: none of the attention tensors
        if not attention:
            names.update(self.deltanet_tensor_names(config, layer))
        elif config.mla is not None:
            names.update(mla_tensor_names(config, hf, pk))
        for proj in "qkvo" if config.mla is None and attention else "":
            if proj != "v" or config.has_v_projection(layer):
                names[pk + f"attn.{proj}"] = hf + f"self_attn.{proj}_proj.weight"
        if "attention_output_gate" in optional and attention:
            names.update(self.gated_query_names(config, layer))
        if "qkv_bias" in optional and attention and config.mla is None:  # latent attention has none
            for proj in "qkv":
                names[pk + f"attn.{proj}_bias"] = hf + f"self_attn.{proj}_proj.bias"
        if "o_bias" in optional and attention:
            names[pk + "attn.o_bias"] = hf + "self_attn.o_proj.bias"
        if "attention_sinks" in optional and attention:
            names[pk + "attn.sinks"] = hf + self.attention_sinks_name
        if config.qk_norm in ("full", "head") and attention:  # "l2" has no weight
            names[pk + "attn.q_norm"] = hf + "self_attn.q_norm.weight"
            names[pk + "attn.k_norm"] = hf + "self_attn.k_norm.weight"
        if "post_norms" in optional:
            names[pk + "attn.post_norm"] = hf + "post_attention_layernorm.weight"
            names[pk + "ffn_post_norm"] = hf + "post_feedforward_layernorm.weight"
        if config.moe_layers[layer]:
            names[pk + "router"] = hf + self.router_name + ".weight"
            if "router_choice_bias" in optional:
                names[pk + "router_choice_bias"] = hf + f"{self.router_name}.{self.router_choice_bias_name}"
            if "router_bias" in optional:
                names[pk + "router_bias"] = hf + f"{self.router_name}.{self.router_bias_name}"
            if config.shared_expert_ffn:
                for part in ("gate", "up", "down"):
                    names[pk + f"shared.{part}"] = hf + f"{self.shared_expert_prefix}.{part}_proj.weight"
                if "shared_expert_gated" in optional:
                    names[pk + "shared_gate"] = hf + "mlp.shared_expert_gate.weight"
        if not config.moe_layers[layer] or config.dense_mlp_with_experts:
            for part in ("gate", "up", "down"):
                names[pk + f"mlp.{part}"] = hf + f"{self.dense_mlp_prefix}.{part}_proj.weight"
        names.update(gemma_layer_tensor_names(config, layer, optional))
        return names

    def deltanet_tensor_names(self, config: ModelConfig, layer: int) -> dict[str, "str | TensorRef"]:
        """A Gated DeltaNet layer's tensors (Qwen3.5 naming: q | k | v in one projection, z, b
        and a apart), pack name -> checkpoint name."""
        hf, pk = f"model.layers.{layer}.linear_attn.", f"layers.{layer}.attn."
        names = {"qkv": "in_proj_qkv.weight", "z": "in_proj_z.weight", "b": "in_proj_b.weight",
                 "a": "in_proj_a.weight", "conv": "conv1d.weight", "A_log": "A_log", "dt_bias": "dt_bias",
                 "norm": "norm.weight", "o": "out_proj.weight"}
        return {pk + name: hf + source for name, source in names.items()}

    def gated_query_names(self, config: ModelConfig, layer: int) -> dict[str, "str | TensorRef"]:
        """attn.q and attn.gate when q's projection also gives the output gate: per head, Hd
        query rows then Hd gate rows (Qwen3.5 / Qwen3-Next q_proj, (2 * H * Hd, D))."""
        H, Hd = config.num_heads, config.head_dim
        q_proj = f"model.layers.{layer}.self_attn.q_proj.weight"
        query_rows = tuple(h * 2 * Hd + i for h in range(H) for i in range(Hd))
        return {f"layers.{layer}.attn.q": TensorRef(q_proj, rows=query_rows),
                f"layers.{layer}.attn.gate": TensorRef(q_proj, rows=tuple(r + Hd for r in query_rows))}

    def zero_centred_norms(self, config: ModelConfig) -> list[str]:
        """Pack names of the norms the checkpoint stores zero-centred (the model scales by
        1 + w): the converter stores 1 + w, so the engine runs a plain RMSNorm."""
        return []


def gemma_layer_tensor_names(config: ModelConfig, layer: int, optional: frozenset[str]) -> dict[str, str]:
    """A layer's tensors of the Gemma 4 features (Gemma's naming, the only family that has
    them): the norms and router parts of a dense MLP beside the experts, per-layer inputs,
    the layer scalar."""
    names = {}
    if config.moe_layers[layer] and config.dense_mlp_with_experts:
        names.update(mlp_post_norm="post_feedforward_layernorm_1.weight", experts_norm="pre_feedforward_layernorm_2.weight",
                     experts_post_norm="post_feedforward_layernorm_2.weight")
    if config.moe_layers[layer] and "router_input_norm" in optional:
        names["router_norm"] = "router.scale"
    if config.moe_layers[layer] and "router_expert_scale" in optional:
        names["router_expert_scale"] = "router.per_expert_scale"
    if config.per_layer_input:
        names.update({"per_layer.gate": "per_layer_input_gate.weight", "per_layer.proj": "per_layer_projection.weight",
                      "per_layer.norm": "post_per_layer_input_norm.weight"})
    if "layer_scalar" in optional:
        names["layer_scalar"] = "layer_scalar"
    return {f"layers.{layer}.{name}": f"model.layers.{layer}.{hf}" for name, hf in names.items()}


def mla_tensor_names(config: ModelConfig, hf: str, pk: str) -> dict[str, str]:
    """A latent-attention layer's tensors (DeepSeek-V2/V3 naming), pack name -> checkpoint name."""
    names = {}
    if config.mla.q_lora_rank:
        names.update({"attn.q_a": "q_a_proj", "attn.q_a_norm": "q_a_layernorm", "attn.q_b": "q_b_proj"})
    else:
        names["attn.q"] = "q_proj"
    names.update({"attn.kv_a": "kv_a_proj_with_mqa", "attn.kv_a_norm": "kv_a_layernorm", "attn.kv_b": "kv_b_proj",
                  "attn.o": "o_proj"})
    return {pk + name: f"{hf}self_attn.{module}.weight" for name, module in names.items()}


# --- readers for Hugging Face config.json values, shared by the architecture modules ---


def require(hf: dict[str, Any], key: str) -> Any:
    if hf.get(key) is None:
        raise UnsupportedConfig(f"config.json lacks required key {key!r}")
    return hf[key]


def head_dim(hf: dict[str, Any]) -> int:
    return hf.get("head_dim") or require(hf, "hidden_size") // require(hf, "num_attention_heads")


def rope_config(hf: dict[str, Any], default_theta: float) -> RopeConfig:
    """Read RoPE settings from either transformers 5 ``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling`` keys that most published checkpoints carry."""
    params = dict(hf.get("rope_parameters") or {})
    legacy_scaling = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", default_theta))
    for key, value in legacy_scaling.items():
        params.setdefault(key, value)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    if rope_type == "linear":
        return RopeConfig(theta=float(theta), type="linear", factor=float(params["factor"]))
    if rope_type == "yarn":
        original = params.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
        return RopeConfig(
            theta=float(theta),
            type="yarn",
            factor=float(params.get("factor") or hf["max_position_embeddings"] / original),
            original_max_position_embeddings=int(original),
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            attention_factor=params.get("attention_factor"),
            truncate=bool(params.get("truncate", True)),
        )
    if rope_type == "llama3":
        missing = [k for k in ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor")
                   if params.get(k) is None]
        if missing:
            raise UnsupportedConfig(f"rope type llama3 needs {', '.join(missing)}")
        return RopeConfig(
            theta=float(theta),
            type="llama3",
            factor=float(params["factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
        )
    raise UnsupportedConfig(f"rope type {rope_type!r} is not supported (supported: default, linear, yarn, llama3)")


def partial_rotary_factor(hf: dict[str, Any], default: float = 1.0) -> float:
    """The share of each head RoPE rotates: in ``rope_parameters`` (transformers 5), in
    ``rope_scaling``, or at the top level (GLM-4.5's published config.json)."""
    for params in (hf.get("rope_parameters") or {}, hf.get("rope_scaling") or {}, hf):
        if params.get("partial_rotary_factor") is not None:
            return float(params["partial_rotary_factor"])
    return default


def rotary_dim(hf: dict[str, Any], head_size: int, default_factor: float = 1.0) -> int:
    """Rotated dims per head, as transformers computes them (int(Hd * factor)); 0 = all."""
    factor = partial_rotary_factor(hf, default_factor)
    if not 0.0 < factor <= 1.0:
        raise UnsupportedConfig(f"partial_rotary_factor must be in (0, 1], got {factor}")
    dims = int(head_size * factor)
    if dims % 2:
        raise UnsupportedConfig(f"partial_rotary_factor {factor} rotates an odd {dims} of {head_size} head dims")
    return 0 if dims == head_size else dims


def attention_bias_tensors(hf: dict[str, Any], o_bias: bool = True) -> frozenset[str]:
    """config.json's ``attention_bias`` as optional tensors: biases on q, k and v, and on o
    unless the family never has one there (``o_bias`` False: GLM-4.5)."""
    if not hf.get("attention_bias", False):
        return frozenset()
    return frozenset({"qkv_bias", "o_bias"} if o_bias else {"qkv_bias"})


def eos_token_ids(hf: dict[str, Any]) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def num_experts(hf: dict[str, Any]) -> int:
    """Expert count; transformers 5 writes some families' count as num_local_experts."""
    count = hf.get("num_experts", hf.get("num_local_experts"))
    if not count:
        raise UnsupportedConfig("config.json has no num_experts / num_local_experts: not an MoE model")
    return int(count)


def sparse_layer_flags(hf: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    """Qwen-style layer plan: MoE where (l+1) % decoder_sparse_step == 0, except mlp_only_layers."""
    step = hf.get("decoder_sparse_step") or 1
    dense_only = set(hf.get("mlp_only_layers") or [])
    return tuple(
        layer not in dense_only and (layer + 1) % step == 0 for layer in range(num_layers)
    )


def qwen_moe_fields(hf: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Expert fields of the Qwen MoE families: a separate moe_intermediate_size, and
    dense MLP layers (of intermediate_size) placed by decoder_sparse_step / mlp_only_layers."""
    return dict(
        num_experts=num_experts(hf),
        num_experts_per_tok=require(hf, "num_experts_per_tok"),
        expert_ffn=require(hf, "moe_intermediate_size"),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_layers=sparse_layer_flags(hf, num_layers),
        dense_ffn=hf.get("intermediate_size") or 0,
    )


def common_fields(hf: dict[str, Any], architecture: str, default_theta: float,
                  partial_rotary: float | None = None) -> dict[str, Any]:
    """The ModelConfig fields every supported family reads the same way. ``partial_rotary``:
    the family's partial_rotary_factor when config.json gives none; None: the family has no
    partial rotary and refuses a factor below 1."""
    num_heads = require(hf, "num_attention_heads")
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedConfig(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
    if partial_rotary is None and partial_rotary_factor(hf) != 1.0:
        raise UnsupportedConfig(f"partial_rotary_factor != 1 is not supported for {architecture}")
    return dict(
        architecture=architecture,
        vocab_size=require(hf, "vocab_size"),
        hidden_size=require(hf, "hidden_size"),
        num_layers=require(hf, "num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=head_dim(hf),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        rope=rope_config(hf, default_theta),
        rotary_dim=0 if partial_rotary is None else rotary_dim(hf, head_dim(hf), partial_rotary),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_token_ids(hf),
    )


class FusedExpertsArchitecture(Architecture):
    """A family whose checkpoints store each layer's experts fused, in ``gate_up_proj`` and
    ``down_proj`` (see fused_gate_up_names): every checkpoint (``experts_always_fused``), or
    those in which for_checkpoint finds the fused tensor (Qwen3.5 publishes both layouts).
    Naming an expert's parts needs F, so for_checkpoint binds it from the config."""

    experts_always_fused = True
    experts_transposed = False  # stored as transformers multiplies them, x @ W (Llama 4)
    fused_expert_ffn: int | None = None  # F, set on the architecture for_checkpoint returns

    def for_checkpoint(self, config: ModelConfig, has_tensor: Callable[[str], bool]) -> "Architecture":
        if not self.experts_always_fused:
            first = config.moe_layer_ids[0] if config.moe_layer_ids else None
            if first is None or not has_tensor(f"model.layers.{first}.{self.experts_prefix}.gate_up_proj"):
                return self
        bound = copy.copy(self)
        bound.fused_expert_ffn = config.expert_ffn
        return bound

    def expert_tensor_names(self, layer: int, expert: int) -> ExpertTensorNames:
        F = self.fused_expert_ffn
        if F is None:
            if self.experts_always_fused:
                raise ValueError(f"{self.name}: expert_tensor_names needs the architecture for_checkpoint() returns")
            return super().expert_tensor_names(layer, expert)  # one tensor per expert and projection
        return fused_gate_up_names(f"model.layers.{layer}.{self.experts_prefix}", expert, F,
                                   transposed=self.experts_transposed)
