"""Qwen3.5-35B-A3B (Qwen/Qwen3.5-35B-A3B; Qwen3.6-35B-A3B has the same layout) with its
published dimensions, fewer layers (default 4: one group of three Gated DeltaNet layers and a
gated full-attention layer, as the 40 published layers repeat it) and a reduced vocabulary
(32768 of 248320, so that the output head does not outweigh four layers), random bf16
weights in the text-only layout (Qwen3_5MoeForCausalLM, model_type qwen3_5_moe_text; experts
fused per layer as transformers 5 saves them).

The GGUF holds the same values the way llama.cpp's converter (Qwen3_5MoeTextModel) writes
them for its qwen35moe architecture: zero-centred RMSNorm weights stored as 1 + w (the
DeltaNet's gated norm stays as it is), A_log stored as A = -exp(A_log), the conv (C, 1, Kc)
as (C, Kc), dt_bias as ssm_dt.bias, and the DeltaNet's value heads reordered from grouped
by key head (K0v0, K0v1, K1v0 ...) to tiled (K0v0, K1v0, ..., K0v1 ...) in every tensor
that has them (the v rows of in_proj_qkv and of the conv, in_proj_z, in_proj_a/b, A_log,
dt_bias, out_proj's columns). The fused experts split into ffn_gate_exps / ffn_up_exps.

Legend: D hidden 2048; DeltaNet 16 key heads, 32 value heads, head dims 128, conv kernel 4;
attention H 16 heads of 256 with an output gate, 2 KV heads, RoPE on 64 of 256 dims; E 256
experts top-8, F expert ffn 512, shared expert 512 with a sigmoid gate; V 32768.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shapes.common import GgufTensor, Shape, TensorSpec, Variant, add_placeholder_vocab, from_checkpoint, import_gguf
from shapes.common import open_checkpoint, random_bf16, random_bf16_vector, stacked, to_bf16_bits, write_gguf_file

VOCAB = 32768  # published: 248320
SIZES = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
             linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
             num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
             vocab_size=VOCAB)
FULL_ATTENTION_INTERVAL = 4
PARTIAL_ROTARY_FACTOR = 0.25
MROPE_SECTIONS = [11, 11, 10, 0]  # what llama.cpp's converter writes; for text all sections see one position


def hf_config(layers: int) -> dict:
    types = ["full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention" for i in range(layers)]
    return {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "num_hidden_layers": layers,
            "layer_types": types, "full_attention_interval": FULL_ATTENTION_INTERVAL,
            "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                                "partial_rotary_factor": PARTIAL_ROTARY_FACTOR,
                                "mrope_section": MROPE_SECTIONS[:3], "mrope_interleaved": True},
            "attention_bias": False, "tie_word_embeddings": False, "eos_token_id": 0, "pad_token_id": None,
            "bos_token_id": None, "mtp_num_hidden_layers": 0, **SIZES}


def zeros_bf16(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A zero-centred norm's weight as published models start it: 0 (the model scales by 1 + w)."""
    return to_bf16_bits(np.zeros(shape, np.float32))


def checkpoint_tensors(c: dict) -> dict[str, TensorSpec]:
    D, V, E, F, Fs = (c["hidden_size"], c["vocab_size"], c["num_experts"], c["moe_intermediate_size"],
                      c["shared_expert_intermediate_size"])
    Hk, Hv, Dk, Dv, Kc = (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                          c["linear_value_head_dim"], c["linear_conv_kernel_dim"])
    H, Hkv, Hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    conv_channels = 2 * Hk * Dk + Hv * Dv
    bf16 = lambda *shape: TensorSpec("BF16", shape, random_bf16)  # noqa: E731  (1-D: ones)
    vector = lambda *shape: TensorSpec("BF16", shape, random_bf16_vector)  # noqa: E731
    centred = lambda *shape: TensorSpec("BF16", shape, zeros_bf16)  # noqa: E731
    tensors = {"model.embed_tokens.weight": bf16(V, D)}
    for layer, kind in enumerate(c["layer_types"]):
        p = f"model.layers.{layer}."
        tensors |= {p + "input_layernorm.weight": centred(D), p + "post_attention_layernorm.weight": centred(D)}
        if kind == "linear_attention":
            a = p + "linear_attn."
            tensors |= {a + "in_proj_qkv.weight": bf16(conv_channels, D), a + "in_proj_z.weight": bf16(Hv * Dv, D),
                        a + "in_proj_b.weight": bf16(Hv, D), a + "in_proj_a.weight": bf16(Hv, D),
                        a + "conv1d.weight": bf16(conv_channels, 1, Kc), a + "A_log": vector(Hv),
                        a + "dt_bias": vector(Hv), a + "norm.weight": bf16(Dv),  # the gated norm: plain weight, ones
                        a + "out_proj.weight": bf16(D, Hv * Dv)}
        else:
            a = p + "self_attn."
            tensors |= {a + "q_proj.weight": bf16(2 * H * Hd, D), a + "k_proj.weight": bf16(Hkv * Hd, D),
                        a + "v_proj.weight": bf16(Hkv * Hd, D), a + "o_proj.weight": bf16(D, H * Hd),
                        a + "q_norm.weight": centred(Hd), a + "k_norm.weight": centred(Hd)}
        m = p + "mlp."
        tensors |= {m + "gate.weight": bf16(E, D),
                    m + "experts.gate_up_proj": bf16(E, 2 * F, D),  # gate rows [0, F), up rows [F, 2F)
                    m + "experts.down_proj": bf16(E, D, F),
                    m + "shared_expert.gate_proj.weight": bf16(Fs, D), m + "shared_expert.up_proj.weight": bf16(Fs, D),
                    m + "shared_expert.down_proj.weight": bf16(D, Fs), m + "shared_expert_gate.weight": bf16(1, D)}
    return tensors | {"model.norm.weight": centred(D), "lm_head.weight": bf16(V, D)}


def tiled_value_heads(values: np.ndarray, axis: int, key_heads: int, head_dim: int) -> np.ndarray:
    """Value heads along ``axis`` from grouped by key head (Hk, Hv / Hk, head_dim) to tiled
    (Hv / Hk, Hk, head_dim), the order llama.cpp's broadcasts over key heads expect."""
    values = np.moveaxis(values, axis, 0)
    n = values.shape[0]
    grouped = values.reshape(key_heads, n // (key_heads * head_dim), head_dim, *values.shape[1:])
    tiled = grouped.swapaxes(0, 1).reshape(values.shape)
    return np.ascontiguousarray(np.moveaxis(tiled, 0, axis))


def write_gguf(checkpoint: Path, out: Path, variant: Variant, c: dict) -> None:
    from colibrid.models.tensor_ref import TensorRef

    gguf = import_gguf()
    ckpt = open_checkpoint(checkpoint)
    D, L, E, F = c["hidden_size"], c["num_hidden_layers"], c["num_experts"], c["moe_intermediate_size"]
    Hk, Hv, Dk, Dv = (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                      c["linear_value_head_dim"])
    q = variant.gguf_type

    def metadata(w) -> None:  # the keys convert_hf_to_gguf.py's Qwen3_5MoeTextModel writes
        w.add_block_count(L)
        w.add_context_length(c["max_position_embeddings"])
        w.add_embedding_length(D)
        w.add_head_count(c["num_attention_heads"])
        w.add_head_count_kv(c["num_key_value_heads"])
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
        w.add_rope_freq_base(c["rope_parameters"]["rope_theta"])
        w.add_rope_dimension_count(int(c["head_dim"] * PARTIAL_ROTARY_FACTOR))
        w.add_rope_dimension_sections(MROPE_SECTIONS)
        w.add_layer_norm_rms_eps(c["rms_norm_eps"])
        w.add_expert_count(E)
        w.add_expert_used_count(c["num_experts_per_tok"])
        w.add_expert_feed_forward_length(F)
        w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
        w.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
        w.add_ssm_state_size(Dk)
        w.add_ssm_group_count(Hk)
        w.add_ssm_time_step_rank(Hv)
        w.add_ssm_inner_size(Dv * Hv)
        w.add_recurrent_layers([t == "linear_attention" for t in c["layer_types"]])
        w.add_full_attention_interval(FULL_ATTENTION_INTERVAL)
        w.add_file_type(gguf.LlamaFileType.ALL_F32 if q == "F32" else getattr(gguf.LlamaFileType, f"MOSTLY_{q}"))
        add_placeholder_vocab(w, c["vocab_size"])

    def derived(gguf_name: str, hf_name: str, qtype: str, transform) -> GgufTensor:
        shape = transform(np.zeros(ckpt.shape_of(hf_name), np.float32)).shape
        return GgufTensor(gguf_name, shape, qtype, lambda: transform(ckpt.read_f32(hf_name)))

    tensor = lambda gguf_name, hf_name, qtype=q: from_checkpoint(ckpt, gguf_name, hf_name, qtype)  # noqa: E731
    plus_one = lambda gguf_name, hf_name: derived(gguf_name, hf_name, "F32", lambda w: w + 1)  # noqa: E731
    tensors = [tensor("token_embd.weight", "model.embed_tokens.weight"),
               plus_one("output_norm.weight", "model.norm.weight"),
               tensor("output.weight", "lm_head.weight")]
    for layer, kind in enumerate(c["layer_types"]):
        p, b = f"model.layers.{layer}.", f"blk.{layer}."
        tensors += [plus_one(b + "attn_norm.weight", p + "input_layernorm.weight"),
                    plus_one(b + "post_attention_norm.weight", p + "post_attention_layernorm.weight")]
        if kind == "linear_attention":
            a = p + "linear_attn."
            qk_rows = 2 * Hk * Dk  # q and k rows (channels) come first and keep their order

            def v_rows_tiled(w: np.ndarray, qk_rows: int = qk_rows) -> np.ndarray:
                return np.concatenate([w[:qk_rows], tiled_value_heads(w[qk_rows:], 0, Hk, Dv)])

            rows_tiled = lambda w: tiled_value_heads(w, 0, Hk, Dv)  # noqa: E731  (Hv * Dv, D)
            columns_tiled = lambda w: tiled_value_heads(w, 1, Hk, Dv)  # noqa: E731  (D, Hv * Dv)
            per_head = lambda w: tiled_value_heads(w, 0, Hk, 1)  # noqa: E731  (Hv,) or (Hv, D)
            conv = lambda w: v_rows_tiled(w[:, 0, :])  # noqa: E731  (C, 1, Kc) -> (C, Kc)
            tensors += [derived(b + "attn_qkv.weight", a + "in_proj_qkv.weight", q, v_rows_tiled),
                        derived(b + "attn_gate.weight", a + "in_proj_z.weight", q, rows_tiled),
                        derived(b + "ssm_beta.weight", a + "in_proj_b.weight", q, per_head),
                        derived(b + "ssm_alpha.weight", a + "in_proj_a.weight", q, per_head),
                        derived(b + "ssm_conv1d.weight", a + "conv1d.weight", "F32", conv),
                        derived(b + "ssm_a", a + "A_log", "F32", lambda w: -np.exp(per_head(w))),
                        derived(b + "ssm_dt.bias", a + "dt_bias", "F32", per_head),
                        tensor(b + "ssm_norm.weight", a + "norm.weight", "F32"),
                        derived(b + "ssm_out.weight", a + "out_proj.weight", q, columns_tiled)]
        else:
            a = p + "self_attn."
            tensors += [tensor(b + "attn_q.weight", a + "q_proj.weight"),  # per head: Hd query rows, Hd gate rows
                        tensor(b + "attn_k.weight", a + "k_proj.weight"),
                        tensor(b + "attn_v.weight", a + "v_proj.weight"),
                        tensor(b + "attn_output.weight", a + "o_proj.weight"),
                        plus_one(b + "attn_q_norm.weight", a + "q_norm.weight"),
                        plus_one(b + "attn_k_norm.weight", a + "k_norm.weight")]
        m = p + "mlp."
        gate_up, down = m + "experts.gate_up_proj", m + "experts.down_proj"
        # one expert at a time: the fused (E, 2F, D) tensor is 2 GB as float32
        expert = lambda name, e, rows=None: ckpt.read_f32(TensorRef(name, (e,), rows))  # noqa: E731
        tensors += [tensor(b + "ffn_gate_inp.weight", m + "gate.weight", "F32"),  # router f32, as in the pack
                    GgufTensor(b + "ffn_gate_exps.weight", (E, F, D), q,
                               stacked(E, lambda e, n=gate_up: expert(n, e, slice(0, F)), q)),
                    GgufTensor(b + "ffn_up_exps.weight", (E, F, D), q,
                               stacked(E, lambda e, n=gate_up: expert(n, e, slice(F, 2 * F)), q)),
                    GgufTensor(b + "ffn_down_exps.weight", (E, D, F), q, stacked(E, lambda e, n=down: expert(n, e), q)),
                    derived(b + "ffn_gate_inp_shexp.weight", m + "shared_expert_gate.weight", "F32", lambda w: w[0]),
                    tensor(b + "ffn_gate_shexp.weight", m + "shared_expert.gate_proj.weight"),
                    tensor(b + "ffn_up_shexp.weight", m + "shared_expert.up_proj.weight"),
                    tensor(b + "ffn_down_shexp.weight", m + "shared_expert.down_proj.weight")]
    write_gguf_file(out, "qwen35moe", metadata, tensors)


SHAPE = Shape(
    name="qwen3_5_moe",
    description="Qwen3.5-35B-A3B shape: D 2048, 3 Gated DeltaNet (16/32 heads of 128) : 1 gated attention "
                "(16 heads of 256 / 2 KV), 256 experts top-8 (F 512) + gated shared expert 512, V 32768, bf16",
    default_layers=4,
    # f32: for greedy_agreement.py (both sides compute in float32 with the same weights)
    variants=(Variant("q8_0", "q8_0", "Q8_0"), Variant("q4_g64", "q4_g64", "Q4_0"), Variant("f32", "f32", "F32")),
    default_variants=("q8_0", "q4_g64"),
    hf_config=hf_config,
    checkpoint_tensors=checkpoint_tensors,
    write_gguf=write_gguf,
)
