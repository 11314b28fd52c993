"""What a pack of a given model must contain: the name, shape and element type of every
tensor, derived from the normalised model configuration, the optional tensors the model has
(colibrid/models/optional_tensors.py) and the requested quantization.

The converter writes by these rules and the reader checks a manifest against them, so a
manifest can only describe the tensors the model needs, in the types the converter would
have chosen (docs/format.md, "Tensor names in dense" and "Element types").
"""

from __future__ import annotations

from colibrid.models.base import Architecture
from colibrid.models.model_config import ModelConfig
from colibrid.models.optional_tensors import OPTIONAL_TENSORS
from colibrid.native import TensorType

TENSOR_CLASSES = ("experts", "dense", "embeddings")
EXPERT_PARTS = ("gate", "up", "down")  # order of the projections inside an expert record
EXPERT_BIAS_PARTS = OPTIONAL_TENSORS["expert_bias"]  # after them, f32, when the model has expert biases
ALWAYS_F32 = ("router", "shared_gate", "conv")  # pack-name leaves kept in f32 whatever --quant says


def tensor_class(pack_name: str) -> str:
    """The --quant class of a dense tensor: "embeddings" for embed/lm_head, else "dense"."""
    if pack_name in ("embed", "lm_head", "per_layer_embed"):
        return "embeddings"
    return "dense"


def requested_type(pack_name: str, ndim: int, quantization: dict[str, str]) -> TensorType:
    """The type asked for a dense tensor: f32 for 1-D tensors, routers and the shared-expert
    gate, else its class's type from the quantization."""
    if ndim == 1 or pack_name.rsplit(".", 1)[-1] in ALWAYS_F32:
        return TensorType.F32
    return TensorType.from_name(quantization[tensor_class(pack_name)])


def stored_type(wanted: TensorType, shape: tuple[int, ...]) -> TensorType:
    """The type a tensor asked to be ``wanted`` is stored in: a block type cannot hold rows
    that are not a whole number of blocks, so such a tensor falls back to f32."""
    if len(shape) == 2 and shape[1] % wanted.block_elems:
        return TensorType.F32
    return wanted


def dense_tensor_names(config: ModelConfig, optional: frozenset[str]) -> list[str]:
    """Every dense tensor a pack of this model with the ``optional`` tensors has, in the order
    the converter writes them. Pack names depend on the config's features and the optional
    tensors only, never on the source architecture."""
    return list(Architecture().dense_tensor_names(config, optional))


def expected_dense_shape(name: str, c: ModelConfig) -> tuple[int, ...]:
    """The shape every pack tensor must have, from the normalised config."""
    layer = int(name.split(".", 2)[1]) if name.startswith("layers.") else 0
    D, V, Hd, P, L = c.hidden_size, c.vocab_size, c.head_dim_of(layer), c.per_layer_input, c.num_layers
    q_out, kv_out = c.num_heads * Hd, c.kv_heads_of(layer) * Hd
    leaf = name.split(".", 2)[-1] if name.startswith("layers.") else name
    ffn = c.shared_expert_ffn if leaf.startswith("shared.") else c.dense_ffn
    shapes = {
        "embed": (V, D), "lm_head": (V, D), "final_norm": (D,),
        "attn_norm": (D,), "ffn_norm": (D,),
        "attn.q": (q_out, D), "attn.k": (kv_out, D), "attn.v": (kv_out, D), "attn.o": (D, q_out),
        "attn.q_bias": (q_out,), "attn.k_bias": (kv_out,), "attn.v_bias": (kv_out,), "attn.o_bias": (D,),
        "attn.q_norm": (q_out,) if c.qk_norm == "full" else (Hd,),
        "attn.k_norm": (kv_out,) if c.qk_norm == "full" else (Hd,),
        "attn.sinks": (c.num_heads,),
        "router": (c.num_experts, D), "router_choice_bias": (c.num_experts,), "router_bias": (c.num_experts,),
        "shared_gate": (1, D),
        "shared.gate": (ffn, D), "shared.up": (ffn, D), "shared.down": (D, ffn),
        "mlp.gate": (ffn, D), "mlp.up": (ffn, D), "mlp.down": (D, ffn),
        # Gemma 4
        "attn.post_norm": (D,), "ffn_post_norm": (D,), "mlp_post_norm": (D,), "experts_norm": (D,),
        "experts_post_norm": (D,), "router_norm": (D,), "router_expert_scale": (c.num_experts,), "layer_scalar": (1,),
        "per_layer_embed": (V, L * P), "per_layer_model_proj": (L * P, D), "per_layer_proj_norm": (P,),
        "per_layer.gate": (P, D), "per_layer.proj": (D, P), "per_layer.norm": (D,),
    }
    if c.mla is not None:
        shapes.update(_mla_shapes(c))
    shapes["attn.gate"] = (q_out, D)
    if name.startswith("layers.") and c.layer_mixer(int(name.split(".")[1])) == "deltanet":
        shapes.update(_deltanet_shapes(c))
    return shapes[leaf]


def _deltanet_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A Gated DeltaNet layer's tensors (see DeltaNetConfig): q | k | v, z, b, a and out
    projections, the conv (C, Kc), A_log, dt_bias and the gated norm's weight."""
    d, D = c.deltanet, c.hidden_size
    Hv, value_width = d.num_value_heads, d.num_value_heads * d.value_head_dim
    return {
        "attn.qkv": (d.conv_channels, D), "attn.z": (value_width, D), "attn.b": (Hv, D), "attn.a": (Hv, D),
        "attn.conv": (d.conv_channels, d.conv_kernel), "attn.A_log": (Hv,), "attn.dt_bias": (Hv,),
        "attn.norm": (d.value_head_dim,), "attn.o": (D, value_width),
    }


def _mla_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Latent attention's tensors (see MlaConfig): q (or q_a, q_b), kv_a, kv_b, o."""
    m, D, H = c.mla, c.hidden_size, c.num_heads
    Cq, C, R = m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
    return {
        "attn.q": (H * c.head_dim, D), "attn.q_a": (Cq, D), "attn.q_a_norm": (Cq,), "attn.q_b": (H * c.head_dim, Cq),
        "attn.kv_a": (C + R, D), "attn.kv_a_norm": (C,), "attn.kv_b": (H * (m.qk_nope_head_dim + m.v_head_dim), C),
        "attn.o": (D, H * m.v_head_dim), "attn.o_bias": (D,),
    }


def expert_part_names(optional: frozenset[str]) -> tuple[str, ...]:
    """The parts of every expert record, in record order: the three matrices, then their f32
    biases when the model has them (``optional`` holds expert_bias; docs/format.md, "Expert
    records")."""
    return EXPERT_PARTS + (EXPERT_BIAS_PARTS if "expert_bias" in optional else ())


def expected_expert_shapes(c: ModelConfig, optional: frozenset[str]) -> dict[str, tuple[int, ...]]:
    D, F = c.hidden_size, c.expert_ffn
    shapes = {"gate": (F, D), "up": (F, D), "down": (D, F), "gate_bias": (F,), "up_bias": (F,), "down_bias": (D,)}
    return {part: shapes[part] for part in expert_part_names(optional)}


def expert_part_type(experts_type: TensorType, shape: tuple[int, ...]) -> TensorType:
    """The type an expert part is stored in: biases (1-D) f32, matrices the experts' type."""
    return TensorType.F32 if len(shape) == 1 else stored_type(experts_type, shape)


def tensor_nbytes(type_: TensorType, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor: rows x row_bytes(cols); a 1-D tensor is one row."""
    rows, cols = (1, shape[0]) if len(shape) == 1 else shape
    return rows * type_.row_bytes(cols)
