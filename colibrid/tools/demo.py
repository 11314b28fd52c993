"""Build a random-weight OLMoE pack so a fresh machine can run Colibri with no download.

    python -m colibrid.tools.demo /var/lib/colibri/demo.pack

The weights are random: the pack exercises every part of Colibri (converter, pack,
engine, experts file, tokenizer, chat template) but its output is meaningless text.
The checkpoint is written in the Hugging Face layout with numpy alone and then goes
through the same converter as any real checkpoint.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np

from colibrid.tools.convert.converter import convert
from colibrid.tools.convert.quant_spec import parse_quant

DEMO_SHAPE = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, num_experts=16, num_experts_per_tok=4)
VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _training_text(limit_bytes: int = 2_000_000) -> list[str]:
    """Some of the Python standard library's sources: text every machine has."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total > limit_bytes:
            break
    return texts


def write_tokenizer(directory: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_text(), trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "chat_template": CHATML,
    }, indent=1))
    return tok.get_vocab_size()


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header, offset = {}, 0
    for name, array in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    header_bytes = json.dumps(header).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for array in tensors.values():
            f.write(np.ascontiguousarray(array, dtype=np.float32).tobytes())


def random_olmoe_tensors(config: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    D, F, V, E = config["hidden_size"], config["intermediate_size"], config["vocab_size"], config["num_experts"]
    Hd = D // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * Hd

    def w(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(V, D), "model.norm.weight": np.ones(D, np.float32), "lm_head.weight": w(V, D)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors |= {
            p + "input_layernorm.weight": np.ones(D, np.float32),
            p + "post_attention_layernorm.weight": np.ones(D, np.float32),
            p + "self_attn.q_proj.weight": w(D, D), p + "self_attn.k_proj.weight": w(kv, D),
            p + "self_attn.v_proj.weight": w(kv, D), p + "self_attn.o_proj.weight": w(D, D),
            p + "self_attn.q_norm.weight": np.ones(D, np.float32), p + "self_attn.k_norm.weight": np.ones(kv, np.float32),
            p + "mlp.gate.weight": w(E, D),
        }
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            tensors |= {q + "gate_proj.weight": w(F, D), q + "up_proj.weight": w(F, D), q + "down_proj.weight": w(D, F)}
    return tensors


def write_demo_config(directory: Path, vocab_size: int) -> dict:
    """The demo shape's OLMoE config.json and generation_config.json in ``directory``; returns the config."""
    config = {
        "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "vocab_size": vocab_size,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "norm_topk_prob": False, "eos_token_id": 0, "pad_token_id": 0,
        "bos_token_id": None, **DEMO_SHAPE,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    return config


def build_demo_checkpoint(directory: Path, seed: int = 0) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(directory)
    config = write_demo_config(directory, vocab)
    write_safetensors(directory / "model.safetensors", random_olmoe_tensors(config, seed))
    return directory


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m colibrid.tools.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="pack directory to create")
    parser.add_argument("--quant", default=None, help="as colibri-convert --quant")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="colibri-demo-") as tmp:
        checkpoint = build_demo_checkpoint(Path(tmp) / "checkpoint", args.seed)
        convert(checkpoint, Path(args.out), parse_quant(args.quant), force=args.force)
    print(f"wrote {args.out}: a RANDOM-WEIGHT OLMoE demo pack (its output is meaningless text)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
