"""The normalised model configuration stored in a pack's manifest.

Every architecture module translates its Hugging Face ``config.json`` into this one
shape at conversion time, so the engine never reads architecture-specific keys and
never branches on an architecture's name: it branches on features (``qk_norm``,
``shared_expert_ffn`` ...). A field is what the engine computes with and the tensors do not
say: dimensions, layer plans, kinds of norm, routing rules, scales. Which optional tensors a
model has (biases, sinks, router extras ...) is not here: the pack's tables say it
(colibrid/models/optional_tensors.py). docs/adding-a-model.md says when a new field is due.

Dimension legend used across the engine:
  T tokens, S context length, D hidden, H query heads, K kv heads, Hd head dim,
  E experts, A active experts per token, F expert ffn, V vocabulary;
  latent attention (MlaConfig): Cq q rank, C kv rank (latent), N nope dims, R rope dims,
  Vd value dims per head, L = C + R latent-cache floats per token;
  Gated DeltaNet (DeltaNetConfig): Hk key heads, Hv value heads, Dk key head dim, Dv value
  head dim, Kc conv kernel, C = 2 * Hk * Dk + Hv * Dv conv channels (q | k | v).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

QK_NORM_KINDS = ("none", "full", "head", "l2")
ROPE_TYPES = ("default", "linear", "yarn", "llama3", "proportional")
ROUTER_SCORINGS = ("softmax", "sigmoid", "topk_softmax", "topk_sigmoid")
EXPERT_ACTIVATIONS = ("swiglu", "clamped_swiglu", "geglu_tanh")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")  # the dense MLPs' gate activation (transformers' names)
GROUP_SCORES = ("max", "top2_sum")
LAYER_MIXERS = ("attention", "deltanet")  # a layer's token mixer: softmax attention, or Gated DeltaNet


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0  # linear / yarn scaling factor
    original_max_position_embeddings: int | None = None  # yarn, llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None = derived from factor
    truncate: bool = True  # yarn
    low_freq_factor: float = 1.0  # llama3: wavelengths above original / low_freq_factor are divided by factor,
    high_freq_factor: float = 4.0  # those below original / high_freq_factor kept, those between interpolated
    partial_rotary_factor: float = 1.0  # proportional (Gemma 4): the first int(factor * Hd / 2) frequency
    # pairs of the whole head, exponents over Hd; the other pairs have frequency 0 (cos 1, sin 0)


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): queries through an optional
    low-rank path, keys and values expanded per head from one shared latent, which is what the
    cache holds. ModelConfig.head_dim is then N + R (the q/k head) and num_kv_heads num_heads."""

    kv_lora_rank: int  # C
    qk_nope_head_dim: int  # N
    qk_rope_head_dim: int  # R, the dims RoPE rotates (last in each q/k head)
    v_head_dim: int  # Vd
    softmax_scale: float  # (N + R)^-0.5, times YaRN's mscale^2 where the rope scaling asks for it
    q_lora_rank: int = 0  # Cq; 0 = one q projection (DeepSeek-V2-Lite)
    rope_interleaved: bool = True  # the rope dims hold interleaved pairs (x0, x1), (x2, x3) ...


@dataclass(frozen=True)
class DeltaNetConfig:
    """Gated DeltaNet linear attention (Qwen3.5 / Qwen3-Next "linear_attention" layers): a
    causal depthwise conv over q | k | v, L2-normalised q and k, a gated delta-rule recurrence
    over a (Dk, Dv) state per value head, then an RMSNorm gated by silu(z). Each sequence keeps
    a conv state (Kc - 1, C) and a recurrent state (Hv, Dk, Dv) instead of a KV cache."""

    num_key_heads: int  # Hk; each serves Hv / Hk consecutive value heads
    num_value_heads: int  # Hv, a multiple of Hk
    key_head_dim: int  # Dk
    value_head_dim: int  # Dv
    conv_kernel: int  # Kc

    @property
    def conv_channels(self) -> int:
        """C: the conv runs over q (Hk * Dk), k (Hk * Dk) and v (Hv * Dv) together."""
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # registry name of the source architecture (informational)
    vocab_size: int  # V
    hidden_size: int  # D
    num_layers: int
    num_heads: int  # H
    num_kv_heads: int  # K
    head_dim: int  # Hd
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    # Attention features.
    qk_norm: str = "none"  # "full": RMSNorm over all heads (OLMoE); "head": per head (Qwen3); "l2": per head
    # without a weight, after RoPE, on the layers with RoPE only (Llama 4's L2 norm)
    clip_qkv: float | None = None  # clamp q, k, v to +-clip_qkv (OLMoE option)
    sliding_window: tuple[int | None, ...] = ()  # per layer: window in tokens, None = full causal
    attention_chunk: tuple[int | None, ...] = ()  # per layer: chunked-local attention span (a token
    # sees its own chunk of this many tokens only), None = none; () = none on every layer
    rotary_dim: int = 0  # leading dims of each head that RoPE rotates (partial rotary); 0 = all Hd
    mla: MlaConfig | None = None  # multi-head latent attention instead of grouped-query attention
    # Hybrid models: per layer, its token mixer (LAYER_MIXERS); () = attention on every layer.
    layer_mixers: tuple[str, ...] = ()
    deltanet: DeltaNetConfig | None = None  # the dims of the "deltanet" layers
    # Mixture of experts.
    num_experts: int = 0  # E
    num_experts_per_tok: int = 0  # A
    expert_ffn: int = 0  # F
    norm_topk_prob: bool = False  # renormalise the top-A probabilities to sum to 1
    moe_layers: tuple[bool, ...] = ()  # per layer: routed experts (True) or a dense MLP (False)
    dense_ffn: int = 0  # ffn width of the dense-MLP layers
    shared_expert_ffn: int = 0  # 0 = no shared expert
    # Routing beyond softmax top-k (DeepSeek-V2/V3, GLM-4.5); the defaults are plain softmax top-k.
    router_scoring: str = "softmax"  # "softmax" over all E, "sigmoid" of each logit, or "topk_softmax":
    # the top A logits first, then a softmax over those A (gpt-oss), or "topk_sigmoid": the top A logits,
    # then the sigmoid of each (Llama 4)
    router_groups: int = 1  # experts split into this many groups of E / groups for the group limit
    router_groups_kept: int = 1  # experts are chosen from the best this-many groups only
    router_group_score: str = "max"  # a group's score: its best choice score, or its best two summed
    routed_scaling_factor: float = 1.0  # the A mixing weights are multiplied by this
    # gpt-oss: a clamped SwiGLU.
    expert_activation: str = "swiglu"  # "swiglu": silu(g) * u; "clamped_swiglu": see swiglu_limit
    swiglu_alpha: float = 1.0  # clamped_swiglu: h = (clamp(u, +-limit) + 1) * g' * sigmoid(alpha * g'),
    swiglu_limit: float = 0.0  # g' = min(g, limit)
    # Llama 4: interleaved-pair RoPE, NoPE layers with attention temperature tuning, the routing weight on the
    # expert's input.
    rope_interleaved: bool = False  # RoPE turns pairs (x0, x1), (x2, x3) ... of each head (complex rotary)
    nope_layers: tuple[bool, ...] = ()  # per layer: True = no RoPE (a NoPE layer); () = RoPE on every layer
    attn_temperature_floor: int = 0  # > 0: on NoPE layers the query of position p is multiplied by
    attn_temperature_scale: float = 0.0  # log1p(floor((p + 1) / floor)) * scale + 1
    router_weight_on_input: bool = False  # an expert runs on weight * x and its output is added unweighted
    # Gemma 4 (colibrid/models/gemma4.py): layers of two shapes, a dense MLP beside the experts,
    # per-layer input embeddings. The defaults switch every one of them off.
    layer_head_dim: tuple[int, ...] = ()  # per layer Hd where layers differ; () = head_dim everywhere
    layer_kv_heads: tuple[int, ...] = ()  # per layer K where layers differ; () = num_kv_heads everywhere
    full_attention_rope: RopeConfig | None = None  # RoPE of the full-attention layers (sliding_window None)
    # when it differs from `rope`, which the sliding ones keep
    values_from_keys: bool = False  # full-attention layers have no v projection: v is k's (before the k norm)
    attention_scale: float = 0.0  # softmax scale of q.k; 0 = Hd^-0.5 (Gemma 4: 1, its q norm does the scaling)
    v_norm: bool = False  # each value head RMS-normed without a weight before it is cached
    dense_mlp_with_experts: bool = False  # MoE layers also run the dense MLP (dense_ffn) beside the experts,
    # each with its own input and output norms, their sum normed by ffn_post_norm
    embed_scale: float = 1.0  # token embeddings times this (Gemma: sqrt(D)); a tied head is not scaled
    final_logit_softcap: float = 0.0  # > 0: logits = cap * tanh(logits / cap)
    per_layer_input: int = 0  # P: width of the per-layer input embeddings (Gemma's PLE); 0 = none
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.qk_norm not in QK_NORM_KINDS:
            raise ValueError(f"qk_norm must be one of {QK_NORM_KINDS}, got {self.qk_norm!r}")
        for rope in (self.rope, self.full_attention_rope or self.rope):
            if rope.type not in ROPE_TYPES:
                raise ValueError(f"rope type must be one of {ROPE_TYPES}, got {rope.type!r}")
        for name in ("layer_head_dim", "layer_kv_heads"):
            if len(getattr(self, name)) not in (0, self.num_layers):
                raise ValueError(f"{name} needs one entry per layer, or none")
        if len(self.moe_layers) != self.num_layers or len(self.sliding_window) != self.num_layers:
            raise ValueError("moe_layers and sliding_window need one entry per layer")
        if self.attention_chunk and len(self.attention_chunk) != self.num_layers:
            raise ValueError("attention_chunk needs one entry per layer, or none at all")
        if len(self.nope_layers) not in (0, self.num_layers):
            raise ValueError("nope_layers needs one entry per layer, or none")
        if self.router_scoring not in ROUTER_SCORINGS or self.router_group_score not in GROUP_SCORES:
            raise ValueError(f"router_scoring must be one of {ROUTER_SCORINGS} and router_group_score one of "
                             f"{GROUP_SCORES}, got {self.router_scoring!r}, {self.router_group_score!r}")
        groups, kept = self.router_groups, self.router_groups_kept
        if groups < 1 or not 1 <= kept <= groups or (self.num_experts and self.num_experts % groups):
            raise ValueError(f"{self.num_experts} experts cannot be routed in {groups} groups keeping {kept}")
        if self.rotary_dim < 0 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"rotary_dim must be even and at most head_dim {self.head_dim}, got {self.rotary_dim}")
        if self.expert_activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"expert_activation must be one of {EXPERT_ACTIVATIONS}, got {self.expert_activation!r}")
        if self.layer_mixers and (len(self.layer_mixers) != self.num_layers
                                  or any(m not in LAYER_MIXERS for m in self.layer_mixers)):
            raise ValueError(f"layer_mixers must name one of {LAYER_MIXERS} per layer, got {self.layer_mixers!r}")
        if ("deltanet" in self.layer_mixers) != (self.deltanet is not None):
            raise ValueError("deltanet dims are needed exactly when a layer's mixer is deltanet")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")

    @property
    def rotated_dims(self) -> int:
        """How many dims of each head RoPE rotates (the width of the cos/sin tables)."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return self.rotary_dim or self.head_dim

    def layer_mixer(self, layer: int) -> str:
        """The token mixer of ``layer``: "attention" or "deltanet"."""
        return self.layer_mixers[layer] if self.layer_mixers else "attention"

    def is_nope(self, layer: int) -> bool:
        """True when ``layer`` has no RoPE (Llama 4's NoPE layers)."""
        return bool(self.nope_layers) and self.nope_layers[layer]

    def head_dim_of(self, layer: int) -> int:
        """Hd of ``layer`` (Gemma 4's full-attention layers have wider heads)."""
        return self.layer_head_dim[layer] if self.layer_head_dim else self.head_dim

    def kv_heads_of(self, layer: int) -> int:
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.num_kv_heads

    def rope_of(self, layer: int) -> RopeConfig:
        """The RoPE settings of ``layer``: full_attention_rope on full-attention layers if set."""
        if self.full_attention_rope is not None and self.sliding_window[layer] is None:
            return self.full_attention_rope
        return self.rope

    def has_v_projection(self, layer: int) -> bool:
        return not (self.values_from_keys and self.sliding_window[layer] is None)

    @property
    def moe_layer_ids(self) -> list[int]:
        return [layer for layer, is_moe in enumerate(self.moe_layers) if is_moe]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ModelConfig":
        data = dict(data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        data["rope"] = RopeConfig(**data["rope"])
        if data.get("full_attention_rope") is not None:
            data["full_attention_rope"] = RopeConfig(**data["full_attention_rope"])
        if data.get("mla") is not None:
            data["mla"] = MlaConfig(**data["mla"])
        if data.get("deltanet") is not None:
            data["deltanet"] = DeltaNetConfig(**data["deltanet"])
        for key in ("sliding_window", "attention_chunk", "moe_layers", "eos_token_ids", "layer_mixers",
                    "nope_layers", "layer_head_dim", "layer_kv_heads"):
            data[key] = tuple(data.get(key, ()))
        return cls(**data)


def parameter_counts(config: ModelConfig, optional: frozenset[str]) -> tuple[int, int]:
    """(total, active per token) parameter counts, embeddings and head included, of a model
    that has the ``optional`` tensors (names of colibrid.models.optional_tensors)."""
    D, V, P = config.hidden_size, config.vocab_size, config.per_layer_input
    norms = 2 * D * (2 if "post_norms" in optional else 1)
    embed = V * D * (1 if config.tie_word_embeddings else 2) + D
    embed += (V + D + 1) * config.num_layers * P + P if P else 0  # per-layer embeddings, projection, norm
    expert = 3 * D * config.expert_ffn + ((2 * config.expert_ffn + D) if "expert_bias" in optional else 0)
    shared = 3 * D * config.shared_expert_ffn + (D if config.shared_expert_ffn and "shared_expert_gated" in optional else 0)
    dense = 3 * D * config.dense_ffn
    total = active = embed
    for layer, is_moe in enumerate(config.moe_layers):
        mixer = _deltanet_parameters(config) if config.layer_mixer(layer) == "deltanet" else \
            _attention_parameters(config, layer, optional)
        per_layer = mixer + norms + (2 * D * P + D if P else 0)
        total += per_layer
        active += per_layer
        if is_moe:
            router = config.num_experts * (D + int("router_choice_bias" in optional) + int("router_bias" in optional))
            beside = dense + 3 * D if config.dense_mlp_with_experts else 0  # the MLP and its extra norms
            total += router + shared + beside + config.num_experts * expert
            active += router + shared + beside + config.num_experts_per_tok * expert
        else:
            total += dense
            active += dense
    return total, active


def _attention_parameters(config: ModelConfig, layer: int, optional: frozenset[str]) -> int:
    """One layer's attention matrices (and sinks)."""
    sinks = config.num_heads if "attention_sinks" in optional else 0
    if config.mla is not None:
        return _mla_parameters(config) + sinks
    D, Hd, K = config.hidden_size, config.head_dim_of(layer), config.kv_heads_of(layer)
    kv = D * K * Hd * (2 if config.has_v_projection(layer) else 1)
    gate = D * config.num_heads * Hd if "attention_output_gate" in optional else 0
    return 2 * D * config.num_heads * Hd + kv + gate + sinks


def _deltanet_parameters(config: ModelConfig) -> int:
    """Parameters of one Gated DeltaNet layer: qkv, z, b, a and out projections, the conv,
    A_log, dt_bias and the gated norm."""
    d, D = config.deltanet, config.hidden_size
    Hv, value_width = d.num_value_heads, d.num_value_heads * d.value_head_dim
    C = d.conv_channels
    return D * (C + value_width + 2 * Hv) + C * d.conv_kernel + 2 * Hv + d.value_head_dim + value_width * D


def _mla_parameters(config: ModelConfig) -> int:
    """Parameters of one latent-attention layer, its q_a and kv_a norms included."""
    m, D, H = config.mla, config.hidden_size, config.num_heads
    QH = H * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    q = D * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * QH if m.q_lora_rank else D * QH
    kv = D * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank + m.kv_lora_rank * H * (m.qk_nope_head_dim + m.v_head_dim)
    return q + kv + H * m.v_head_dim * D
