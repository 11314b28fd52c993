"""Check a parsed manifest against the model it describes: every tensor the model needs and
no other, each with the shape and element type the converter would have written, aligned,
inside its file and overlapping no other; the expert index one record per expert, in order,
without gaps. Every error names the tensor (or the expert) and the file.

Only the manifest is read here; Pack.open compares the sizes with the files on disk, and
the checksums with their bytes.
"""

from __future__ import annotations

import math
from typing import Any

from colibrid.models.model_config import LAYER_MIXERS, ModelConfig
from colibrid.native import TensorType
from colibrid.pack.layout import (
    dense_tensor_names,
    expected_dense_shape,
    expected_expert_shapes,
    expert_part_names,
    expert_part_type,
    requested_type,
    stored_type,
    tensor_nbytes,
)
from colibrid.pack.manifest import (
    DENSE_FILE,
    EXPERT_PART_ALIGN_BYTES,
    EXPERTS_FILE,
    MAX_DIM,
    Manifest,
    TensorEntry,
)

MIN_ALIGNMENT = 4096
MAX_ALIGNMENT = 1 << 30
MAX_LAYERS = 1 << 16
MAX_EXPERTS = 1 << 16

# ModelConfig fields by kind; every dimension is an integer >= 1 (or >= 0 where 0 means "none").
POSITIVE_INT_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                       "max_position_embeddings", "num_experts", "num_experts_per_tok", "expert_ffn")
COUNT_FIELDS = ("dense_ffn", "shared_expert_ffn", "per_layer_input")
BOOL_FIELDS = ("tie_word_embeddings", "norm_topk_prob", "rope_interleaved", "router_weight_on_input",
               "values_from_keys", "v_norm", "dense_mlp_with_experts")


def check_manifest(m: Manifest) -> None:
    """Raise ValueError naming the first thing in ``m`` that a correct pack cannot hold."""
    check_model_config(m.model)
    if not MIN_ALIGNMENT <= m.alignment <= MAX_ALIGNMENT or m.alignment & (m.alignment - 1):
        raise ValueError(f"alignment {m.alignment} is not a power of two in [{MIN_ALIGNMENT}, {MAX_ALIGNMENT}]")
    optional = _optional_tensors(m)
    _check_dense_tensors(m, optional)
    _check_expert_parts(m, optional)
    _check_expert_index(m)
    _check_experts_device(m)


def _optional_tensors(m: Manifest) -> frozenset[str]:
    """The optional tensors the tables must hold: those they hold, or, where the manifest's
    model section states one, as it states it, so that a table disagreeing with its flag shows
    as a tensor missing or one too many. The model must be able to use each of them."""
    stated = m.model_flags
    optional = {name for name in m.optional_tensors if stated.get(name, True)}
    optional |= {name for name, present in stated.items() if present}
    if m.model.mla is not None and "qkv_bias" in optional:
        raise ValueError("latent attention has no q/k/v biases, q/k norms, clipping or sliding windows")
    if "shared_expert_gated" in optional and m.model.shared_expert_ffn == 0:
        raise ValueError("model.shared_expert_ffn is 0 but the model needs it (a shared expert's gate)")
    return frozenset(optional)


# --- the model configuration ---


def check_model_config(c: ModelConfig) -> None:
    """Numbers the engine sizes buffers and loops by: integers where integers are meant, in range."""
    for name in POSITIVE_INT_FIELDS:
        _config_int(c, name, 1)
    for name in COUNT_FIELDS:
        _config_int(c, name, 0)
    for name in BOOL_FIELDS:
        if type(getattr(c, name)) is not bool:
            raise ValueError(f"model.{name} must be true or false, got {getattr(c, name)!r:.40}")
    if c.num_layers > MAX_LAYERS or c.num_experts > MAX_EXPERTS:
        raise ValueError(f"model has {c.num_layers} layers of {c.num_experts} experts; "
                         f"at most {MAX_LAYERS} and {MAX_EXPERTS}")
    if c.num_experts_per_tok > c.num_experts:
        raise ValueError(f"model.num_experts_per_tok {c.num_experts_per_tok} exceeds num_experts {c.num_experts}")
    if c.num_heads % c.num_kv_heads:
        raise ValueError(f"model.num_heads {c.num_heads} is not a multiple of num_kv_heads {c.num_kv_heads}")
    if not all(type(flag) is bool for flag in c.moe_layers):
        raise ValueError("model.moe_layers must hold true or false per layer")
    if not all(w is None or (type(w) is int and 1 <= w <= MAX_DIM) for w in c.sliding_window):
        raise ValueError("model.sliding_window must hold null or a window of >= 1 tokens per layer")
    if not all(w is None or (type(w) is int and 1 <= w <= MAX_DIM) for w in c.attention_chunk):
        raise ValueError("model.attention_chunk must hold null or a chunk of >= 1 tokens per layer")
    _check_nope_layers(c)
    _check_layer_shapes(c)
    if (not all(c.moe_layers) or c.dense_mlp_with_experts) and c.dense_ffn == 0:
        raise ValueError("model.dense_ffn is 0 but the model needs it")
    _check_router(c)
    _check_expert_activation(c)
    if type(c.rotary_dim) is not int or not 0 <= c.rotary_dim <= c.head_dim:
        raise ValueError(f"model.rotary_dim must be an integer in [0, head_dim {c.head_dim}], got {c.rotary_dim!r:.40}")
    if c.mla is not None:
        _check_mla(c)
    _check_layer_mixers(c)
    _positive_float(c.rms_norm_eps, "model.rms_norm_eps")
    if c.clip_qkv is not None:
        _positive_float(c.clip_qkv, "model.clip_qkv")
    _check_rope(c.rope, "model.rope")
    if c.full_attention_rope is not None:
        _check_rope(c.full_attention_rope, "model.full_attention_rope")
    for name in ("embed_scale", "final_logit_softcap", "attention_scale"):
        if _finite_float(getattr(c, name), f"model.{name}") < 0:
            raise ValueError(f"model.{name} must be >= 0, got {getattr(c, name)!r:.40}")
    _positive_float(c.embed_scale, "model.embed_scale")
    token_ids = ([] if c.bos_token_id is None else [c.bos_token_id]) + list(c.eos_token_ids)
    if not all(type(t) is int and 0 <= t < c.vocab_size for t in token_ids):
        raise ValueError(f"model.bos_token_id / eos_token_ids must be token ids below vocab_size {c.vocab_size}")


def _check_router(c: ModelConfig) -> None:
    """The group limit must leave every token enough experts to choose from: libcolibri would
    refuse the routing call at every step, so a pack that asks for it fails here, at open."""
    for name in ("router_groups", "router_groups_kept"):
        _config_int(c, name, 1)
    groups, kept = c.router_groups, c.router_groups_kept
    if c.num_experts % groups or kept > groups:
        raise ValueError(f"model.router_groups {groups} (keeping {kept}) does not divide {c.num_experts} experts")
    if c.num_experts_per_tok > kept * (c.num_experts // groups):
        raise ValueError(f"model.num_experts_per_tok {c.num_experts_per_tok} exceeds the "
                         f"{kept * (c.num_experts // groups)} experts of the {kept} groups kept")
    if c.router_group_score == "top2_sum" and groups > 1 and c.num_experts // groups < 2:
        raise ValueError("model.router_group_score top2_sum needs at least 2 experts per group")
    _positive_float(c.routed_scaling_factor, "model.routed_scaling_factor")


def _check_nope_layers(c: ModelConfig) -> None:
    """Llama 4's NoPE layers and the temperature tuning of their queries."""
    if not all(type(flag) is bool for flag in c.nope_layers):
        raise ValueError("model.nope_layers must hold true or false per layer")
    _config_int(c, "attn_temperature_floor", 0)
    _finite_float(c.attn_temperature_scale, "model.attn_temperature_scale")


def _check_expert_activation(c: ModelConfig) -> None:
    """gpt-oss's clamped SwiGLU needs a clamp > 0 and a finite gain (libcolibri refuses others)."""
    if c.expert_activation == "clamped_swiglu":
        _positive_float(c.swiglu_limit, "model.swiglu_limit")
        _finite_float(c.swiglu_alpha, "model.swiglu_alpha")


def _check_mla(c: ModelConfig) -> None:
    """Latent attention: its dimensions, and the head shape they imply for the rest."""
    m = c.mla
    for name, low in (("kv_lora_rank", 1), ("qk_nope_head_dim", 0), ("qk_rope_head_dim", 2), ("v_head_dim", 1),
                      ("q_lora_rank", 0)):
        value = getattr(m, name)
        if type(value) is not int or not low <= value <= MAX_DIM:
            raise ValueError(f"model.mla.{name} must be an integer in [{low}, {MAX_DIM}], got {value!r:.40}")
    if m.qk_rope_head_dim % 2:
        raise ValueError(f"model.mla.qk_rope_head_dim must be even, got {m.qk_rope_head_dim}")
    if type(m.rope_interleaved) is not bool:
        raise ValueError("model.mla.rope_interleaved must be true or false")
    _positive_float(m.softmax_scale, "model.mla.softmax_scale")
    if c.head_dim != m.qk_nope_head_dim + m.qk_rope_head_dim or c.num_kv_heads != c.num_heads or c.rotary_dim:
        raise ValueError("latent attention needs head_dim = qk_nope_head_dim + qk_rope_head_dim, num_kv_heads = "
                         "num_heads and rotary_dim 0")
    if c.qk_norm != "none" or c.clip_qkv is not None or any(c.sliding_window) or any(c.attention_chunk):
        raise ValueError("latent attention has no q/k/v biases, q/k norms, clipping or sliding windows")
    if c.rope_interleaved or any(c.nope_layers) or c.attn_temperature_floor:
        raise ValueError("latent attention has its own rope layout (mla.rope_interleaved), no NoPE layers and no "
                         "temperature tuning")


def _check_layer_mixers(c: ModelConfig) -> None:
    """Hybrid models: one known mixer per layer, and the Gated DeltaNet dims the engine sizes
    its states and libcolibri its buffers by."""
    if not isinstance(c.layer_mixers, tuple) or (c.layer_mixers and len(c.layer_mixers) != c.num_layers) \
            or not all(m in LAYER_MIXERS for m in c.layer_mixers):
        raise ValueError(f"model.layer_mixers must be empty or name one of {list(LAYER_MIXERS)} per layer")
    if ("deltanet" in c.layer_mixers) != (c.deltanet is not None):
        raise ValueError("model.deltanet must be given exactly when a layer's mixer is deltanet")
    if c.deltanet is None:
        return
    d = c.deltanet
    for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel"):
        value = getattr(d, name)
        if type(value) is not int or not 1 <= value <= MAX_DIM:
            raise ValueError(f"model.deltanet.{name} must be an integer in [1, {MAX_DIM}], got {value!r:.40}")
    if d.num_value_heads % d.num_key_heads:
        raise ValueError(f"model.deltanet.num_value_heads {d.num_value_heads} is not a multiple of num_key_heads "
                         f"{d.num_key_heads}")
    if c.mla is not None:
        raise ValueError("Gated DeltaNet layers do not mix with latent attention")


def _check_layer_shapes(c: ModelConfig) -> None:
    """Per-layer head shapes (Gemma 4): integers in range, the heads a multiple of the kv heads."""
    for name in ("layer_head_dim", "layer_kv_heads"):
        values = getattr(c, name)
        if len(values) not in (0, c.num_layers) or not all(type(v) is int and 1 <= v <= MAX_DIM for v in values):
            raise ValueError(f"model.{name} must be empty or hold an integer in [1, {MAX_DIM}] per layer")
    for layer in range(c.num_layers):
        if c.head_dim_of(layer) % 2 or c.num_heads % c.kv_heads_of(layer):
            raise ValueError(f"layer {layer}: head dim {c.head_dim_of(layer)} must be even and num_heads "
                             f"{c.num_heads} a multiple of its {c.kv_heads_of(layer)} kv heads")
    if c.mla is not None and (c.layer_head_dim or c.layer_kv_heads or c.values_from_keys or c.v_norm):
        raise ValueError("latent attention has no per-layer head shapes, values from keys or v norm")


def _check_rope(rope, what: str) -> None:
    _positive_float(rope.theta, f"{what}.theta")
    _positive_float(rope.factor, f"{what}.factor")
    _finite_float(rope.beta_fast, f"{what}.beta_fast")
    _finite_float(rope.beta_slow, f"{what}.beta_slow")
    if rope.attention_factor is not None:
        _finite_float(rope.attention_factor, f"{what}.attention_factor")
    original = rope.original_max_position_embeddings
    if original is not None and not (type(original) is int and 1 <= original <= MAX_DIM):
        raise ValueError(f"{what}.original_max_position_embeddings must be an integer >= 1, got {original!r:.40}")
    if type(rope.truncate) is not bool:
        raise ValueError(f"{what}.truncate must be true or false")
    factor = _finite_float(rope.partial_rotary_factor, f"{what}.partial_rotary_factor")
    if not 0 < factor <= 1:
        raise ValueError(f"{what}.partial_rotary_factor must be in (0, 1], got {factor!r:.40}")
    _positive_float(rope.low_freq_factor, f"{what}.low_freq_factor")
    _positive_float(rope.high_freq_factor, f"{what}.high_freq_factor")
    if rope.type == "llama3" and original is None:
        raise ValueError(f"{what} of type llama3 needs original_max_position_embeddings")


def _config_int(c: ModelConfig, name: str, low: int) -> None:
    value = getattr(c, name)
    if type(value) is not int or not low <= value <= MAX_DIM:
        raise ValueError(f"model.{name} must be an integer in [{low}, {MAX_DIM}], got {value!r:.40}")


def _finite_float(value: Any, what: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r:.40}")
    return value


def _positive_float(value: Any, what: str) -> None:
    if _finite_float(value, what) <= 0:
        raise ValueError(f"{what} must be > 0, got {value!r:.40}")


# --- dense tensors ---


def _check_dense_tensors(m: Manifest, optional: frozenset[str]) -> None:
    needed = dense_tensor_names(m.model, optional)
    missing = [name for name in needed if name not in m.dense_tensors]
    if missing:
        raise ValueError(f"tensor {missing[0]!r} of {DENSE_FILE} is missing from the manifest "
                         f"({len(missing)} missing in all)")
    unknown = sorted(set(m.dense_tensors) - set(needed))
    if unknown:
        raise ValueError(f"tensor {unknown[0]!r:.80} in {DENSE_FILE} is not one this model has")
    spans = []
    for name, entry in m.dense_tensors.items():
        where = f"dense tensor {name!r} in {DENSE_FILE}"
        shape = expected_dense_shape(name, m.model)
        _check_entry(entry, where, shape, stored_type(requested_type(name, len(shape), m.quantization), shape))
        if entry.offset % m.alignment:
            raise ValueError(f"{where}: offset {entry.offset} is not a multiple of the alignment {m.alignment}")
        if entry.offset + entry.nbytes > m.dense_size:
            raise ValueError(f"{where}: bytes {entry.offset}..{entry.offset + entry.nbytes} lie past the end of "
                             f"{DENSE_FILE} ({m.dense_size} bytes)")
        spans.append((entry.offset, entry.offset + entry.nbytes, where))
    _check_no_overlap(spans)


def _check_entry(entry: TensorEntry, where: str, shape: tuple[int, ...], type_: TensorType) -> None:
    """Shape, type and byte count exactly as the converter writes them for this model."""
    if entry.shape != shape:
        raise ValueError(f"{where}: shape {list(entry.shape)}, the model needs {list(shape)}")
    if entry.type != type_.name_in_pack:
        # Also catches a type swapped for one of the same size (f16 <-> bf16), which the byte
        # count alone cannot: the type of every tensor follows from the recorded quantization.
        raise ValueError(f"{where}: type {entry.type}, but this pack's quantization stores it as {type_.name_in_pack}")
    nbytes = tensor_nbytes(type_, shape)
    if entry.nbytes != nbytes:
        raise ValueError(f"{where}: nbytes {entry.nbytes}, but {type_.name_in_pack} {list(shape)} is {nbytes} bytes")


def _check_no_overlap(spans: list[tuple[int, int, str]]) -> None:
    spans = sorted(spans)
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"{second} overlaps {first} (bytes from {start} to {end})")


# --- experts ---


def _check_expert_parts(m: Manifest, optional: frozenset[str]) -> None:
    if not m.expert_parts and not m.model.moe_layer_ids:
        return  # no routed experts at all: nothing to lay out
    names = expert_part_names(optional)
    if tuple(m.expert_parts) != names:
        raise ValueError(f"experts.parts must be {list(names)} in that order, got {list(m.expert_parts)[:7]}")
    shapes = expected_expert_shapes(m.model, optional)
    experts_type = TensorType.from_name(m.quantization["experts"])
    spans = []
    for name, entry in m.expert_parts.items():
        where = f"expert part {name!r} in {EXPERTS_FILE}"
        _check_entry(entry, where, shapes[name], expert_part_type(experts_type, shapes[name]))
        if entry.offset % EXPERT_PART_ALIGN_BYTES:
            raise ValueError(f"{where}: offset {entry.offset} in the record is not a multiple of {EXPERT_PART_ALIGN_BYTES}")
        spans.append((entry.offset, entry.offset + entry.nbytes, where))
    _check_no_overlap(spans)


def _check_expert_index(m: Manifest) -> None:
    """One record per (MoE layer, expert), sorted, each starting where the previous one ends."""
    c = m.model
    expected = len(c.moe_layer_ids) * c.num_experts
    if len(m.expert_records) != expected:
        raise ValueError(f"the {EXPERTS_FILE} index has {len(m.expert_records)} records, the model needs {expected} "
                         f"({len(c.moe_layer_ids)} MoE layers x {c.num_experts} experts)")
    parts_end = max((e.offset + e.nbytes for e in m.expert_parts.values()), default=0)
    wanted = ((layer, expert) for layer in c.moe_layer_ids for expert in range(c.num_experts))
    cursor = 0
    for number, (record, (layer, expert)) in enumerate(zip(m.expert_records, wanted)):
        where = f"expert {expert} of layer {layer} in {EXPERTS_FILE} (index row {number})"
        if (record.layer, record.expert) != (layer, expert):
            raise ValueError(f"{EXPERTS_FILE} index row {number} is expert {record.expert} of layer {record.layer}; "
                             f"rows are sorted by layer, then expert, so it must be expert {expert} of layer {layer}")
        if record.offset != cursor:
            raise ValueError(f"{where}: offset {record.offset}, expected {cursor} (records follow each other without gaps)")
        if record.length % m.alignment or record.length < parts_end:
            raise ValueError(f"{where}: length {record.length} is not a multiple of the alignment {m.alignment} "
                             f"holding the {parts_end} bytes of its parts")
        if record.offset + record.length > m.experts_size:
            raise ValueError(f"{where}: bytes {record.offset}..{record.offset + record.length} lie past the end of "
                             f"{EXPERTS_FILE} ({m.experts_size} bytes)")
        cursor += record.length
    if cursor != m.experts_size:
        raise ValueError(f"the records of {EXPERTS_FILE} end at byte {cursor}, experts.size says {m.experts_size}")


def _check_experts_device(m: Manifest) -> None:
    """A device's region starts after the superblock, on the alignment, so every record stays
    aligned on the device; its logical block size divides the alignment, so O_DIRECT reads
    of whole records are possible."""
    device = m.experts_device
    if device is None:
        return
    block = device.logical_block_size
    if block < 512 or block & (block - 1) or block > m.alignment:
        raise ValueError(f"experts.device.logical_block_size {block} is not a power of two in [512, alignment "
                         f"{m.alignment}]")
    if device.region_offset < m.alignment or device.region_offset % m.alignment:
        raise ValueError(f"experts.device.region_offset {device.region_offset} is not a positive multiple of the "
                         f"alignment {m.alignment}")
