"""Optional tensors: the weights some families have and others do not.

Biases on q/k/v and o, attention sinks, the attention output gate, Gemma's post norms, the
router's extra terms, the shared expert's gate, the layer scalar and the experts' biases.
Whether a model has one is a fact about its weights, not a number the engine computes with,
so it is not a ModelConfig field: the architecture module says at conversion which ones its
checkpoint holds (Architecture.optional_tensors), the pack's tables hold them or not, and the
engine uses such a tensor where it finds one.

Each is named by the model flag that announced it while these were ModelConfig fields. A
manifest's model section still states each one as that flag, written from the tables, so a
manifest reads as it always did (docs/format.md, "Optional tensors"); the reader checks the
flags against the tables.
"""

from __future__ import annotations

from collections.abc import Iterable

# name -> the tensors it stands for: pack names under ``layers.{l}.`` in dense.bin, on every
# layer it applies to (base.Architecture.layer_tensor_names says which), or expert record parts
OPTIONAL_TENSORS: dict[str, tuple[str, ...]] = {
    "qkv_bias": ("attn.q_bias", "attn.k_bias", "attn.v_bias"),  # attention layers (H*Hd), (K*Hd), (K*Hd)
    "o_bias": ("attn.o_bias",),  # attention layers (D)
    "attention_sinks": ("attn.sinks",),  # attention layers (H): gpt-oss
    "attention_output_gate": ("attn.gate",),  # attention layers (H*Hd, D): Qwen3.5, Qwen3-Next
    "post_norms": ("attn.post_norm", "ffn_post_norm"),  # every layer (D): Gemma's sandwich norms
    "router_bias": ("router_bias",),  # MoE layers (E): added to the logits (gpt-oss)
    "router_choice_bias": ("router_choice_bias",),  # MoE layers (E): added to choose only (DeepSeek-V3, GLM-4.5)
    "router_input_norm": ("router_norm",),  # MoE layers (D): the router norms its own input (Gemma 4)
    "router_expert_scale": ("router_expert_scale",),  # MoE layers (E): scales each chosen weight (Gemma 4)
    "shared_expert_gated": ("shared_gate",),  # MoE layers with a shared expert (1, D): Qwen2-MoE, Qwen3.5
    "layer_scalar": ("layer_scalar",),  # every layer (1): Gemma 4
    "expert_bias": ("gate_bias", "up_bias", "down_bias"),  # expert record parts (F), (F), (D): gpt-oss
}


def check_names(names: Iterable[str]) -> frozenset[str]:
    """``names`` as a frozenset, every one of them an optional tensor's name."""
    names = frozenset(names)
    unknown = sorted(names - OPTIONAL_TENSORS.keys())
    if unknown:
        raise ValueError(f"unknown optional tensors {unknown} (known: {', '.join(OPTIONAL_TENSORS)})")
    return names


def optional_tensors_in(dense_names: Iterable[str], expert_parts: Iterable[str]) -> frozenset[str]:
    """The optional tensors a pack's tables hold: those of which at least one tensor appears,
    as a dense tensor of some layer or as an expert part. (That a layer holding none of them
    lacks it is the validator's to find: it then expects it on every such layer.)"""
    leaves = {name.split(".", 2)[2] for name in dense_names if name.startswith("layers.") and name.count(".") >= 2}
    leaves.update(expert_parts)
    return frozenset(name for name, tensors in OPTIONAL_TENSORS.items() if leaves.intersection(tensors))
