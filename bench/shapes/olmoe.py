"""OLMoE-1B-7B (allenai/OLMoE-1B-7B-0924) as published: 16 layers, every one MoE, 64 experts
top-8, bf16. Legend: D hidden 2048, F expert ffn 1024, E 64 experts, V 50304."""

from __future__ import annotations

from pathlib import Path

from shapes.common import Shape, TensorSpec, Variant, add_placeholder_vocab, experts_from_checkpoint, from_checkpoint
from shapes.common import import_gguf, open_checkpoint, random_bf16, write_gguf_file

SIZES = dict(hidden_size=2048, intermediate_size=1024, num_attention_heads=16, num_key_value_heads=16, num_experts=64,
             num_experts_per_tok=8, vocab_size=50304)


def hf_config(layers: int) -> dict:
    return {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
            "norm_topk_prob": False, "eos_token_id": 0, "pad_token_id": 0, "bos_token_id": None,
            "num_hidden_layers": layers, **SIZES}


def checkpoint_tensors(c: dict) -> dict[str, TensorSpec]:
    D, F, V, E = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_experts"]
    kv = c["num_key_value_heads"] * (D // c["num_attention_heads"])
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes |= {p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                   p + "self_attn.q_proj.weight": (D, D), p + "self_attn.k_proj.weight": (kv, D),
                   p + "self_attn.v_proj.weight": (kv, D), p + "self_attn.o_proj.weight": (D, D),
                   p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (kv,),
                   p + "mlp.gate.weight": (E, D)}
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            shapes |= {q + "gate_proj.weight": (F, D), q + "up_proj.weight": (F, D), q + "down_proj.weight": (D, F)}
    return {name: TensorSpec("BF16", shape, random_bf16) for name, shape in shapes.items()}


def write_gguf(checkpoint: Path, out: Path, variant: Variant, c: dict) -> None:
    gguf = import_gguf()
    ckpt = open_checkpoint(checkpoint)
    D, F, E, L, V = c["hidden_size"], c["intermediate_size"], c["num_experts"], c["num_hidden_layers"], c["vocab_size"]
    q = variant.gguf_type

    def metadata(w) -> None:
        w.add_context_length(4096)
        w.add_embedding_length(D)
        w.add_block_count(L)
        w.add_feed_forward_length(F)
        w.add_head_count(c["num_attention_heads"])
        w.add_head_count_kv(c["num_key_value_heads"])
        w.add_rope_freq_base(c["rope_theta"])
        w.add_layer_norm_rms_eps(c["rms_norm_eps"])
        w.add_expert_count(E)
        w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_file_type(getattr(gguf.LlamaFileType, f"MOSTLY_{q}"))
        add_placeholder_vocab(w, V)

    tensor = lambda gguf_name, hf_name, qtype: from_checkpoint(ckpt, gguf_name, hf_name, qtype)  # noqa: E731
    tensors = [tensor("token_embd.weight", "model.embed_tokens.weight", q),
               tensor("output_norm.weight", "model.norm.weight", "F32"),
               tensor("output.weight", "lm_head.weight", q)]
    for layer in range(L):
        p, b = f"model.layers.{layer}.", f"blk.{layer}."
        tensors += [tensor(b + "attn_norm.weight", p + "input_layernorm.weight", "F32"),
                    tensor(b + "ffn_norm.weight", p + "post_attention_layernorm.weight", "F32")]
        for ours, theirs in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
            tensors.append(tensor(b + theirs + ".weight", p + f"self_attn.{ours}.weight", q))
        tensors += [tensor(b + "attn_q_norm.weight", p + "self_attn.q_norm.weight", "F32"),
                    tensor(b + "attn_k_norm.weight", p + "self_attn.k_norm.weight", "F32"),
                    tensor(b + "ffn_gate_inp.weight", p + "mlp.gate.weight", "F32")]  # router f32, as in the pack
        for ours, theirs in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
            tensors.append(experts_from_checkpoint(ckpt, b + theirs + ".weight",
                                                   lambda e, ours=ours, p=p: f"{p}mlp.experts.{e}.{ours}.weight", E, q))
    write_gguf_file(out, "olmoe", metadata, tensors)


SHAPE = Shape(
    name="olmoe",
    description="OLMoE-1B-7B shape: D 2048, 64 experts top-8 (F 1024), 16 heads, V 50304, bf16",
    default_layers=16,
    variants=(Variant("q8_0", "q8_0", "Q8_0"), Variant("q4_g64", "q4_g64", "Q4_0")),
    default_variants=("q8_0", "q4_g64"),
    hf_config=hf_config,
    checkpoint_tensors=checkpoint_tensors,
    write_gguf=write_gguf,
    legacy_prefix="checkpoint",
)
