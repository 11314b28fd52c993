"""DeepSeek-V3 (deepseek-ai/DeepSeek-V3) with its published dimensions but fewer layers and a
smaller vocabulary, FP8 e4m3 with 128x128 block scales as published (the embeddings, head,
norms and router bf16). Default: 2 layers, the first dense (as first_k_dense_replace 1
makes it), the second MoE: the real model has 61 (3 dense), 671 B parameters.

Legend: D hidden 7168, H 128 heads, Q q_lora 1536, C kv_lora 512, N qk_nope 128, R qk_rope 64,
Vd v_head 128, E 256 experts top-8 (8 groups, 4 kept), F expert ffn 2048, one shared expert
of F, dense ffn 18432, V 32768 (the real 129280 reduced).

llama.cpp runs it as its "deepseek2" architecture: MLA as MQA over the latent (one KV head of
C + R), kv_b split into attn_k_b (H, C, N) and attn_v_b (H, Vd, C), as its
convert_hf_to_gguf.py writes them.
"""

from __future__ import annotations

from pathlib import Path

from shapes.common import GgufTensor, Shape, TensorSpec, Variant, add_placeholder_vocab, experts_from_checkpoint
from shapes.common import fp8_weight, from_checkpoint, import_gguf, open_checkpoint, random_bf16, random_f32_vector
from shapes.common import write_gguf_file

VOCAB = 32768
SIZES = dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=128,
             num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8, n_group=8,
             topk_group=4, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
             qk_nope_head_dim=128, v_head_dim=128, first_k_dense_replace=1, vocab_size=VOCAB)
ROPE = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}


def hf_config(layers: int) -> dict:
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": layers,
            "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": ROPE,
            "hidden_act": "silu", "tie_word_embeddings": False, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
            "norm_topk_prob": True, "attention_bias": False, "bos_token_id": 0, "eos_token_id": 1,
            "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [128, 128]}, **SIZES}


def checkpoint_tensors(c: dict) -> dict[str, TensorSpec]:
    D, V, H, E = c["hidden_size"], c["vocab_size"], c["num_attention_heads"], c["n_routed_experts"]
    Q, C, N, R, Vd = c["q_lora_rank"], c["kv_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    F, dense_F = c["moe_intermediate_size"], c["intermediate_size"]
    bf16 = lambda *shape: TensorSpec("BF16", shape, random_bf16)  # noqa: E731
    tensors = {"model.embed_tokens.weight": bf16(V, D)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        tensors |= {p + "input_layernorm.weight": bf16(D), a + "q_a_layernorm.weight": bf16(Q),
                    a + "kv_a_layernorm.weight": bf16(C), p + "post_attention_layernorm.weight": bf16(D)}
        tensors |= fp8_weight(a + "q_a_proj.weight", Q, D) | fp8_weight(a + "q_b_proj.weight", H * (N + R), Q)
        tensors |= fp8_weight(a + "kv_a_proj_with_mqa.weight", C + R, D) | fp8_weight(a + "kv_b_proj.weight", H * (N + Vd), C)
        tensors |= fp8_weight(a + "o_proj.weight", D, H * Vd)
        if layer < c["first_k_dense_replace"]:
            tensors |= fp8_weight(p + "mlp.gate_proj.weight", dense_F, D) | fp8_weight(p + "mlp.up_proj.weight", dense_F, D)
            tensors |= fp8_weight(p + "mlp.down_proj.weight", D, dense_F)
            continue
        tensors |= {p + "mlp.gate.weight": bf16(E, D),
                    p + "mlp.gate.e_score_correction_bias": TensorSpec("F32", (E,), random_f32_vector)}
        for expert in [f"experts.{e}" for e in range(E)] + ["shared_experts"]:
            q = f"{p}mlp.{expert}."
            width = F * (c["n_shared_experts"] if expert == "shared_experts" else 1)
            tensors |= fp8_weight(q + "gate_proj.weight", width, D) | fp8_weight(q + "up_proj.weight", width, D)
            tensors |= fp8_weight(q + "down_proj.weight", D, width)
    return tensors | {"model.norm.weight": bf16(D), "lm_head.weight": bf16(V, D)}


def write_gguf(checkpoint: Path, out: Path, variant: Variant, c: dict) -> None:
    gguf = import_gguf()
    ckpt = open_checkpoint(checkpoint)
    D, L, H, E = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["n_routed_experts"]
    C, N, R, Vd = c["kv_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    q = variant.gguf_type

    def metadata(w) -> None:  # the keys convert_hf_to_gguf.py's DeepseekV2Model writes
        w.add_block_count(L)
        w.add_context_length(c["max_position_embeddings"])
        w.add_embedding_length(D)
        w.add_feed_forward_length(c["intermediate_size"])
        w.add_head_count(H)
        w.add_head_count_kv(1)  # MLA runs as MQA over the latent
        w.add_rope_freq_base(c["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(ROPE["factor"])
        w.add_rope_scaling_orig_ctx_len(ROPE["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(ROPE["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(ROPE["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * ROPE["mscale_all_dim"])
        w.add_layer_norm_rms_eps(c["rms_norm_eps"])
        w.add_expert_count(E)
        w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_expert_group_count(c["n_group"])
        w.add_expert_group_used_count(c["topk_group"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_leading_dense_block_count(c["first_k_dense_replace"])
        w.add_vocab_size(c["vocab_size"])
        w.add_q_lora_rank(c["q_lora_rank"])
        w.add_kv_lora_rank(C)
        w.add_key_length(C + R)
        w.add_value_length(C)
        w.add_key_length_mla(N + R)
        w.add_value_length_mla(Vd)
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
        w.add_expert_shared_count(c["n_shared_experts"])
        w.add_expert_weights_scale(c["routed_scaling_factor"])
        w.add_expert_weights_norm(c["norm_topk_prob"])
        w.add_rope_dimension_count(R)
        w.add_file_type(gguf.LlamaFileType.ALL_F32 if q == "F32" else getattr(gguf.LlamaFileType, f"MOSTLY_{q}"))
        add_placeholder_vocab(w, c["vocab_size"])

    def kv_b_part(layer: int, part: str):
        """attn_k_b (H, C, N): each head's key rows of kv_b, transposed; attn_v_b (H, Vd, C)."""
        def make():
            kv_b = ckpt.read_f32(f"model.layers.{layer}.self_attn.kv_b_proj.weight").reshape(H, N + Vd, C)
            return kv_b[:, :N, :].transpose(0, 2, 1).copy() if part == "k" else kv_b[:, N:, :].copy()
        return make

    tensor = lambda gguf_name, hf_name, qtype=q: from_checkpoint(ckpt, gguf_name, hf_name, qtype)  # noqa: E731
    tensors = [tensor("token_embd.weight", "model.embed_tokens.weight"),
               tensor("output_norm.weight", "model.norm.weight", "F32"),
               tensor("output.weight", "lm_head.weight")]
    for layer in range(L):
        p, a, b = f"model.layers.{layer}.", f"model.layers.{layer}.self_attn.", f"blk.{layer}."
        tensors += [tensor(b + "attn_norm.weight", p + "input_layernorm.weight", "F32"),
                    tensor(b + "attn_q_a_norm.weight", a + "q_a_layernorm.weight", "F32"),
                    tensor(b + "attn_kv_a_norm.weight", a + "kv_a_layernorm.weight", "F32"),
                    tensor(b + "attn_q_a.weight", a + "q_a_proj.weight"),
                    tensor(b + "attn_q_b.weight", a + "q_b_proj.weight"),
                    tensor(b + "attn_kv_a_mqa.weight", a + "kv_a_proj_with_mqa.weight"),
                    GgufTensor(b + "attn_k_b.weight", (H, C, N), q, kv_b_part(layer, "k")),
                    GgufTensor(b + "attn_v_b.weight", (H, Vd, C), q, kv_b_part(layer, "v")),
                    tensor(b + "attn_output.weight", a + "o_proj.weight"),
                    tensor(b + "ffn_norm.weight", p + "post_attention_layernorm.weight", "F32")]
        if layer < c["first_k_dense_replace"]:
            tensors += [tensor(b + f"ffn_{part}.weight", p + f"mlp.{part}_proj.weight") for part in ("gate", "up", "down")]
            continue
        tensors += [tensor(b + "ffn_gate_inp.weight", p + "mlp.gate.weight", "F32"),  # router f32, as in the pack
                    tensor(b + "exp_probs_b.bias", p + "mlp.gate.e_score_correction_bias", "F32")]
        for part in ("gate", "up", "down"):
            tensors.append(experts_from_checkpoint(ckpt, b + f"ffn_{part}_exps.weight",
                                                   lambda e, part=part, p=p: f"{p}mlp.experts.{e}.{part}_proj.weight", E, q))
        tensors += [tensor(b + f"ffn_{part}_shexp.weight", p + f"mlp.shared_experts.{part}_proj.weight")
                    for part in ("gate", "up", "down")]
    write_gguf_file(out, "deepseek2", metadata, tensors)


SHAPE = Shape(
    name="deepseek_v3",
    description=f"DeepSeek-V3 shape: D 7168, MLA (H 128, q_lora 1536, kv_lora 512), 256 experts top-8 (F 2048) "
                f"+ 1 shared, sigmoid routing in 8 groups keeping 4, first layer dense (18432), V {VOCAB}, FP8",
    default_layers=2,
    # f32: for greedy_agreement.py on small --layers (both sides compute in float32)
    variants=(Variant("q4_g64", "q4_g64", "Q4_0"), Variant("q8_0", "q8_0", "Q8_0"), Variant("f32", "f32", "F32")),
    default_variants=("q4_g64",),
    hf_config=hf_config,
    checkpoint_tensors=checkpoint_tensors,
    write_gguf=write_gguf,
)
