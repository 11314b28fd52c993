"""A tiny OLMoE pack whose greedy answer is chosen by the test: a Hermes tool call.

Every layer's attention output projection and every expert's down projection are zero, so
each layer adds nothing and the last hidden state is the input token's embedding; the head
then maps each token of a chain to the next one (its row holds the normalised embedding of
the token before it, so that token's logit is D times larger than any other's). The chain
starts at the last token of the chat template's generation prompt ("\n" after
"<|im_start|>assistant"), so any conversation is answered with

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call><|endoftext|>

written as four added tokens (one of them the whole JSON). The chat template is the Hermes
one of tests/hermes_template.py, which renders `tools`. Nothing in the engine knows about it:
the pack goes through the converter like any checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Tokenizer

from colibrid.tools.convert.converter import convert
from colibrid.tools.convert.quant_spec import parse_quant
from colibrid.tools.demo import random_olmoe_tensors, write_demo_config, write_safetensors, write_tokenizer
from tests.hermes_template import HERMES_TEMPLATE

CALL_JSON = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ANSWER_TOKENS = ["<tool_call>", CALL_JSON, "</tool_call>"]
ANSWER_TEXT = "".join(ANSWER_TOKENS)


def _rms_normalised(vectors: np.ndarray) -> np.ndarray:
    return vectors / np.sqrt(np.mean(vectors * vectors, axis=-1, keepdims=True) + 1e-5)


def build_steered_pack(work_dir: Path) -> Path:
    checkpoint = work_dir / "steered-checkpoint"
    checkpoint.mkdir(parents=True)
    write_tokenizer(checkpoint)
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(text, special=False, normalized=False) for text in ANSWER_TOKENS])
    tokenizer.save(str(checkpoint / "tokenizer.json"))
    config_path = checkpoint / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["chat_template"] = HERMES_TEMPLATE
    config_path.write_text(json.dumps(tokenizer_config))

    vocab = tokenizer.get_vocab_size()
    config = write_demo_config(checkpoint, vocab)
    tensors = random_olmoe_tensors(config, seed=1)
    for name, tensor in tensors.items():
        if name.endswith(("self_attn.o_proj.weight", "down_proj.weight")):
            tensor[...] = 0.0  # the layer adds nothing: the last hidden state is the embedding
    chain = [tokenizer.token_to_id(token) for token in ["Ċ", *ANSWER_TOKENS, "<|endoftext|>"]]
    assert None not in chain and len(set(chain)) == len(chain), chain
    head = np.zeros_like(tensors["lm_head.weight"])  # (V, D)
    embeddings = tensors["model.embed_tokens.weight"]  # (V, D)
    for before, after in zip(chain, chain[1:]):
        head[after] = _rms_normalised(embeddings[before])
    tensors["lm_head.weight"] = head
    write_safetensors(checkpoint / "model.safetensors", tensors)
    pack = work_dir / "steered.pack"
    convert(checkpoint, pack, parse_quant("f32"), progress=False)
    return pack
