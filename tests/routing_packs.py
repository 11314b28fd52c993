"""Tiny OLMoE packs whose routing the test chooses: healthy (spread over the experts) or
collapsed (every token sends expert 0 its top choice).

Every attention output projection and expert down projection is zero, so no layer changes
the residual stream: each MoE layer's router sees the input token's own (normed) embedding.
With random embeddings and router rows, different tokens choose different experts - a
healthy router (sample at temperature 1 for varied tokens). The collapsed pack adds one
large constant channel to every embedding and gives expert 0's router row a large weight on
it alone, so expert 0's logit dwarfs the others for every token. Numpy only, like colibrid.tools.demo;
the checkpoints go through the converter as any checkpoint does.
"""

from __future__ import annotations

from pathlib import Path


from colibrid.tools.convert.converter import convert
from colibrid.tools.convert.quant_spec import parse_quant
from colibrid.tools.demo import random_olmoe_tensors, write_demo_config, write_safetensors, write_tokenizer

CONSTANT_CHANNEL = 0  # the embedding dimension the collapsed pack makes constant
COLLAPSED_EXPERT = 0


def build_routing_pack(work_dir: Path, collapsed: bool, seed: int = 3) -> Path:
    name = "collapsed" if collapsed else "healthy"
    checkpoint = work_dir / f"{name}-checkpoint"
    checkpoint.mkdir(parents=True)
    vocab = write_tokenizer(checkpoint)
    config = write_demo_config(checkpoint, vocab)
    tensors = random_olmoe_tensors(config, seed=seed)
    for tensor_name, tensor in tensors.items():
        if tensor_name.endswith(("self_attn.o_proj.weight", "down_proj.weight")):
            tensor[...] = 0.0  # the layer adds nothing: every router sees the token's embedding
    if collapsed:
        tensors["model.embed_tokens.weight"][:, CONSTANT_CHANNEL] = 1.0  # 20x the other entries' spread
        for layer in range(config["num_hidden_layers"]):
            router = tensors[f"model.layers.{layer}.mlp.gate.weight"]  # (E, D)
            router[COLLAPSED_EXPERT, :] = 0.0
            router[COLLAPSED_EXPERT, CONSTANT_CHANNEL] = 10.0
    write_safetensors(checkpoint / "model.safetensors", tensors)
    pack = work_dir / f"{name}.pack"
    convert(checkpoint, pack, parse_quant("f32"), progress=False)
    return pack
