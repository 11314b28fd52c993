"""gpt-oss-20b (openai/gpt-oss-20b) with its published dimensions and fewer layers (default 8
of 24), laid out as OpenAI publishes it: MXFP4 experts (*_blocks / *_scales, U8), everything
else bf16. The experts keep their MXFP4 bytes on both sides (the pack's mxfp4 blocks and
GGML's MXFP4 blocks hold the same exponent and codes); attention and embeddings are q8_0
on both sides, as llama.cpp's own gpt-oss GGUFs ship them.

Legend: D hidden 2880, H 64 heads of 64, 8 KV heads, sliding window 128 on every other layer
(first), sinks, E 32 experts top-4, F expert ffn 2880, V 201088.
"""

from __future__ import annotations

from pathlib import Path

from shapes.common import GgufTensor, Shape, TensorSpec, Variant, add_placeholder_vocab, from_checkpoint, import_gguf
from shapes.common import open_checkpoint, random_bf16, random_bf16_vector, random_mxfp4_blocks, random_mxfp4_scales
from shapes.common import write_gguf_file

SIZES = dict(hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
             num_local_experts=32, num_experts_per_tok=4, experts_per_token=4, sliding_window=128, vocab_size=201088)
ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096}
GROUP = 32  # MXFP4 values per exponent


def hf_config(layers: int) -> dict:
    return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "num_hidden_layers": layers,
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            "max_position_embeddings": 131072, "initial_context_length": 4096, "rms_norm_eps": 1e-5,
            "rope_theta": 150000.0, "rope_scaling": ROPE, "hidden_act": "silu", "swiglu_limit": 7.0,
            "attention_bias": True, "tie_word_embeddings": False, "eos_token_id": 200002, "pad_token_id": 199999,
            "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}, **SIZES}


def checkpoint_tensors(c: dict) -> dict[str, TensorSpec]:
    D, V, E, F = c["hidden_size"], c["vocab_size"], c["num_local_experts"], c["intermediate_size"]
    q_out, kv_out = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    bf16 = lambda *shape: TensorSpec("BF16", shape, random_bf16)  # noqa: E731  (1-D: norms, ones)
    vector = lambda *shape: TensorSpec("BF16", shape, random_bf16_vector)  # noqa: E731  (biases, sinks)
    tensors = {"model.embed_tokens.weight": bf16(V, D)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        a, x = p + "self_attn.", p + "mlp.experts."
        tensors |= {p + "input_layernorm.weight": bf16(D), p + "post_attention_layernorm.weight": bf16(D),
                    a + "q_proj.weight": bf16(q_out, D), a + "q_proj.bias": vector(q_out),
                    a + "k_proj.weight": bf16(kv_out, D), a + "k_proj.bias": vector(kv_out),
                    a + "v_proj.weight": bf16(kv_out, D), a + "v_proj.bias": vector(kv_out),
                    a + "o_proj.weight": bf16(D, q_out), a + "o_proj.bias": vector(D),
                    a + "sinks": vector(c["num_attention_heads"]),
                    p + "mlp.router.weight": bf16(E, D), p + "mlp.router.bias": vector(E),
                    # (E, 2F, D): gate on even rows, up on odd; (E, D, F): down
                    x + "gate_up_proj_blocks": TensorSpec("U8", (E, 2 * F, D // GROUP, GROUP // 2), random_mxfp4_blocks),
                    x + "gate_up_proj_scales": TensorSpec("U8", (E, 2 * F, D // GROUP), random_mxfp4_scales),
                    x + "gate_up_proj_bias": vector(E, 2 * F),
                    x + "down_proj_blocks": TensorSpec("U8", (E, D, F // GROUP, GROUP // 2), random_mxfp4_blocks),
                    x + "down_proj_scales": TensorSpec("U8", (E, D, F // GROUP), random_mxfp4_scales),
                    x + "down_proj_bias": vector(E, D)}
    return tensors | {"model.norm.weight": bf16(D), "lm_head.weight": bf16(V, D)}


def write_gguf(checkpoint: Path, out: Path, variant: Variant, c: dict) -> None:
    from colibrid.models.tensor_ref import TensorRef

    gguf = import_gguf()
    ckpt = open_checkpoint(checkpoint)
    D, L, E, F = c["hidden_size"], c["num_hidden_layers"], c["num_local_experts"], c["intermediate_size"]
    q = variant.gguf_type

    def metadata(w) -> None:  # the keys convert_hf_to_gguf.py's GptOssModel writes
        w.add_block_count(L)
        w.add_context_length(c["max_position_embeddings"])
        w.add_embedding_length(D)
        w.add_feed_forward_length(F)
        w.add_head_count(c["num_attention_heads"])
        w.add_head_count_kv(c["num_key_value_heads"])
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(ROPE["factor"])
        w.add_rope_scaling_orig_ctx_len(ROPE["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(ROPE["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(ROPE["beta_slow"])
        w.add_rope_freq_base(c["rope_theta"])
        w.add_layer_norm_rms_eps(c["rms_norm_eps"])
        w.add_expert_count(E)
        w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
        w.add_sliding_window(c["sliding_window"])
        w.add_expert_feed_forward_length(F)
        w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
        add_placeholder_vocab(w, c["vocab_size"])

    def experts(name: str, rows: slice | None, shape: tuple[int, ...]) -> GgufTensor:
        """MXFP4 bytes as they are: the pack's mxfp4 rows are GGML's MXFP4 blocks."""
        return GgufTensor("", shape, "MXFP4", lambda: ckpt.read_mxfp4(TensorRef(name, (), rows)))

    def bias_rows(name: str, rows: slice) -> GgufTensor:
        return GgufTensor("", (E, F), "F32", lambda: ckpt.read_f32(name)[:, rows].copy())

    def named(gguf_name: str, tensor: GgufTensor) -> GgufTensor:
        tensor.name = gguf_name
        return tensor

    tensor = lambda gguf_name, hf_name, qtype=q: from_checkpoint(ckpt, gguf_name, hf_name, qtype)  # noqa: E731
    tensors = [tensor("token_embd.weight", "model.embed_tokens.weight"),
               tensor("output_norm.weight", "model.norm.weight", "F32"),
               tensor("output.weight", "lm_head.weight")]
    even, odd = slice(0, None, 2), slice(1, None, 2)
    for layer in range(L):
        p, a, b = f"model.layers.{layer}.", f"model.layers.{layer}.self_attn.", f"blk.{layer}."
        x = p + "mlp.experts."
        tensors += [tensor(b + "attn_norm.weight", p + "input_layernorm.weight", "F32"),
                    tensor(b + "post_attention_norm.weight", p + "post_attention_layernorm.weight", "F32")]
        for ours, theirs in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
            tensors += [tensor(b + theirs + ".weight", a + ours + ".weight"), tensor(b + theirs + ".bias", a + ours + ".bias", "F32")]
        tensors += [tensor(b + "attn_sinks.weight", a + "sinks", "F32"),
                    tensor(b + "ffn_gate_inp.weight", p + "mlp.router.weight", "F32"),  # router f32, as in the pack
                    tensor(b + "ffn_gate_inp.bias", p + "mlp.router.bias", "F32"),
                    named(b + "ffn_gate_exps.weight", experts(x + "gate_up_proj", even, (E, F, D))),
                    named(b + "ffn_gate_exps.bias", bias_rows(x + "gate_up_proj_bias", even)),
                    named(b + "ffn_up_exps.weight", experts(x + "gate_up_proj", odd, (E, F, D))),
                    named(b + "ffn_up_exps.bias", bias_rows(x + "gate_up_proj_bias", odd)),
                    named(b + "ffn_down_exps.weight", experts(x + "down_proj", None, (E, D, F))),
                    tensor(b + "ffn_down_exps.bias", x + "down_proj_bias", "F32")]
    write_gguf_file(out, "gpt-oss", metadata, tensors)


SHAPE = Shape(
    name="gpt_oss_20b",
    description="gpt-oss-20b shape: D 2880, 64 heads of 64 / 8 KV, window 128 every other layer, sinks, "
                "32 experts top-4 (F 2880) MXFP4, V 201088",
    default_layers=8,
    # the experts stay MXFP4 (not named in --quant); attention and embeddings q8_0 on both sides
    # mxfp4-f32: for greedy_agreement.py (the rest computes in float32 on both sides)
    variants=(Variant("mxfp4", "dense=q8_0,embeddings=q8_0", "Q8_0", gguf_name="MXFP4_Q8_0"),
              Variant("mxfp4-f32", "dense=f32,embeddings=f32", "F32", gguf_name="MXFP4_F32")),
    default_variants=("mxfp4",),
    hf_config=hf_config,
    checkpoint_tensors=checkpoint_tensors,
    write_gguf=write_gguf,
)
