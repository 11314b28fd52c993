"""Build tiny random Hugging Face MoE checkpoints with transformers (the oracle), no network,
and compare the engine with the oracle.

Each spec names an architecture and config overrides; :func:`build_checkpoint` writes a
checkpoint directory exactly as ``save_pretrained`` does (optionally sharded, optionally
bf16), with a small byte-level BPE tokenizer and a ChatML template.
:func:`assert_same_model` is the one comparison every model test makes: the engine's logits
against transformers' at every position of a prompt, then the same greedy continuation.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Mixture-of-Experts models route each token to a few experts.",
    "Colibri streams experts from NVMe into a page cache. Café, naïve, 中文, emoji 🙂.",
    "import os\nimport sys\nprint(sys.argv)\n",
] * 4
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

ARCH_CLASSES = {
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM),
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
    "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
    "gemma4_text": (transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM),
    "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM),
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
    "llama4": (transformers.Llama4TextConfig, transformers.Llama4ForCausalLM),
    # the published multimodal layout: text_config, model.language_model.*, a vision tower
    "qwen3_5_moe_vl": (transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration),
}
# Multimodal wrappers: the text model (an ARCH_CLASSES key) whose config goes under text_config,
# and the wrapper's own settings (a tiny vision tower).
WRAPPED = {
    "qwen3_5_moe_vl": ("qwen3_5_moe", dict(vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                                                              out_hidden_size=64))),
}

# Sizes keep every matrix row a multiple of 64 so every quantized type applies.
BASE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, rms_norm_eps=1e-5)
EXPERTS = {
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=64),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                      shared_expert_intermediate_size=128, intermediate_size=128),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, intermediate_size=128),
    "glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, intermediate_size=128,
                     first_k_dense_replace=1),
    # sinks on every layer, sliding and full layers alternating, a window shorter than the test prompts
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64, head_dim=16, sliding_window=4),
}
# Latent attention (C 64, N 32, R 16, Vd 32; kv heads = heads: MLA has no GQA), a shared
# expert, a dense first layer, 4 groups of 2 experts keeping 2.
_DEEPSEEK = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, intermediate_size=128,
                 first_k_dense_replace=1, n_shared_experts=1, num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=64,
                 qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_group=4, topk_group=2)
EXPERTS.update(deepseek_v2=_DEEPSEEK, deepseek_v3=_DEEPSEEK)
# Hybrid Gated DeltaNet / gated attention (three linear layers to one full), more value heads
# than key heads (4 : 2), conv kernel 4, a gated shared expert, partial rotary 0.25 (4 of 16 dims).
_QWEN3_5 = dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64)
EXPERTS.update(qwen3_5_moe=_QWEN3_5, qwen3_next={**_QWEN3_5, "intermediate_size": 128})
# Llama 4: 4 layers, MoE on layers 1 and 3 (dense MLPs of width 128 on 0 and 2), top-1 of 8 experts plus a
# shared expert; layer 3 is a NoPE layer (full attention, temperature tuning that moves every 4 tokens),
# layers 0-2 rotate interleaved pairs and attend in chunks of 8 tokens, shorter than the test prompts.
EXPERTS["llama4"] = dict(num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=1, intermediate_size=64,
                         intermediate_size_mlp=128, interleave_moe_layer_step=2, head_dim=16,
                         attention_chunk_size=8, floor_scale=4, attn_scale=0.5)
# Gemma 4's MoE block beside a dense MLP; sliding layers (Hd 16, 2 kv heads, window 4) and full
# ones (Hd 32, 1 kv head, values from the keys, proportional RoPE), per-layer inputs (P 16) and
# logit soft-capping. The per-layer vocabulary is the tokenizer's (build_checkpoint sets it).
EXPERTS["gemma4_text"] = dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=64,
                              intermediate_size=128, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
                              attention_k_eq_v=True, sliding_window=4, hidden_size_per_layer_input=16,
                              final_logit_softcapping=30.0)


@dataclass(frozen=True)
class CheckpointSpec:
    arch: str
    overrides: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"  # dtype the checkpoint is saved in: float32 or bfloat16
    max_shard_size: str | None = None  # e.g. "40KB" to force a sharded checkpoint
    seed: int = 0
    train_steps: int = 0  # > 0: briefly train on CORPUS so predictions are confident, as in real models

    @property
    def name(self) -> str:
        extra = "-".join(f"{k}={v}" for k, v in sorted(self.overrides.items()))
        shard = "-sharded" if self.max_shard_size else ""
        trained = f"-t{self.train_steps}" if self.train_steps else ""
        return f"{self.arch}-{self.dtype}{shard}-s{self.seed}{trained}-{extra}".replace(" ", "").replace("[", "").replace("]", "").replace(",", "_")


def build_tokenizer(directory: Path) -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", chat_template=CHATML
    )
    fast.save_pretrained(directory)
    return fast


def _randomize(model: torch.nn.Module, std: float, seed: int) -> None:
    """Give every parameter, norms and biases included, and the routers' saved bias buffers
    a random value, so the oracle test exercises each of them (transformers initialises
    norms to exactly 1 and the routers' choice bias to exactly 0)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.ndim == 1 and ("norm" in name or name.endswith("scale")):  # Gemma 4's router scales too
                p.copy_(1.0 + 0.2 * noise)
            elif p.ndim == 1:
                p.copy_(0.1 * noise)
            else:
                p.copy_(std * noise)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a saved buffer (DeepSeek-V3, GLM-4.5 routers)
                b.copy_(0.1 * torch.randn(b.shape, generator=gen, dtype=torch.float32))
            if name.endswith("layer_scalar"):  # a saved buffer (Gemma 4's per-layer output scale)
                b.copy_(1.0 + 0.2 * torch.randn(b.shape, generator=gen, dtype=torch.float32))


def corpus_token_ids(tokenizer) -> list[int]:
    return tokenizer("".join(CORPUS), add_special_tokens=False)["input_ids"]


def train_on_corpus(model: torch.nn.Module, ids: list[int], steps: int, seed: int, seq_len: int = 48) -> float:
    """A few hundred AdamW steps of next-token prediction on the tiny corpus: enough for
    the peaked, confident distributions of a trained model. Returns the final loss."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.tensor(ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - seq_len - 1, (8,), generator=gen)
        batch = torch.stack([data[s : s + seq_len + 1] for s in starts.tolist()])
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return loss.item()


def build_checkpoint(spec: CheckpointSpec, directory: Path, init_std: float = 0.1) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(directory)
    config_cls, model_cls = ARCH_CLASSES[spec.arch]
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    if spec.arch in WRAPPED:
        text_arch, wrapper = WRAPPED[spec.arch]
        # deep copies: transformers fills nested dicts (rope_parameters) in place, which would rename the spec
        text = copy.deepcopy({**BASE, **EXPERTS[text_arch], **spec.overrides})
        config = config_cls(text_config=dict(vocab_size=len(tokenizer), eos_token_id=eos, pad_token_id=eos,
                                             bos_token_id=None, **text), **wrapper)
    else:
        kwargs = copy.deepcopy({**BASE, **EXPERTS[spec.arch], **spec.overrides})
        if "hidden_size_per_layer_input" in kwargs:  # Gemma's per-layer embeddings: the tokenizer's vocabulary
            kwargs.setdefault("vocab_size_per_layer_input", len(tokenizer))
        config = config_cls(vocab_size=len(tokenizer), eos_token_id=eos, pad_token_id=eos, bos_token_id=None, **kwargs)
    torch.manual_seed(spec.seed)
    model = model_cls(config)
    if spec.train_steps:
        train_on_corpus(model, corpus_token_ids(tokenizer), spec.train_steps, spec.seed)
    else:
        _randomize(model, init_std, spec.seed)
    if spec.dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    save_kwargs = {"max_shard_size": spec.max_shard_size} if spec.max_shard_size else {}
    model.save_pretrained(directory, **save_kwargs)
    return directory


def load_reference(directory: Path) -> torch.nn.Module:
    """The transformers model in float32 (bf16 checkpoints are widened exactly)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return model.eval()


def reference_logits(model: torch.nn.Module, ids: list[int]):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def reference_greedy(model: torch.nn.Module, ids: list[int], n_tokens: int) -> list[int]:
    """Greedy continuation by full re-evaluation each step (no KV cache in the oracle)."""
    seq = list(ids)
    for _ in range(n_tokens):
        seq.append(int(reference_logits(model, seq)[-1].argmax()))
    return seq[len(ids):]


# --- the engine against the oracle ---

PROMPT_TOKENS = 32
GREEDY_TOKENS = 32
# The largest logit difference allowed, as a share of the largest |logit| of the oracle: float32
# sums in another order differ by far less, a wrong feature (a missing bias, a norm in the wrong
# place, another rope) by far more.
LOGIT_TOLERANCE = 1e-4


def random_prompt(vocab_size: int, tokens: int = PROMPT_TOKENS, seed: int = 1) -> list[int]:
    """``tokens`` token ids drawn uniformly from the vocabulary: every embedding row is as
    likely, and a random model has no favourite text."""
    return np.random.default_rng(seed).integers(0, vocab_size, tokens).tolist()


def assert_same_logits(reference: torch.nn.Module, engine, ids: list[int]) -> None:
    """The engine's logits (T, V) for ``ids`` are transformers' at every position, within
    LOGIT_TOLERANCE of the largest |logit|."""
    expected = reference_logits(reference, ids)
    actual = engine.forward(ids)
    assert actual.shape == expected.shape
    assert np.abs(actual - expected).max() <= LOGIT_TOLERANCE * np.abs(expected).max()


def assert_same_model(reference: torch.nn.Module, engine, ids: list[int], greedy_tokens: int = GREEDY_TOKENS) -> None:
    """The engine is the transformers model on ``ids``: the same logits (assert_same_logits),
    then the same ``greedy_tokens`` greedy tokens (the engine decoding with its caches, the
    oracle re-reading the whole sequence at every step)."""
    assert_same_logits(reference, engine, ids)
    assert engine.greedy(ids, greedy_tokens) == reference_greedy(reference, ids, greedy_tokens)
