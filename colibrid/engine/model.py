"""The transformer forward pass over a pack: embeddings, N x (attention, MoE or dense
MLP), final norm, output head. Knows features, never architecture names."""

from __future__ import annotations

import numpy as np

from colibrid import native
from colibrid.engine.attention import Attention
from colibrid.engine.deltanet import DeltaNet
from colibrid.engine.experts import ExpertSource
from colibrid.engine.kv_cache import SequenceCache
from colibrid.engine.layers import linear, rms_norm
from colibrid.engine.mla import LatentAttention
from colibrid.engine.moe import DenseMlp, MoeBlock
from colibrid.engine.rope import Rotary
from colibrid.pack.reader import Pack
from colibrid.pack.tensor import PackedTensor


def _dense(pack: Pack, name: str) -> PackedTensor:
    """A dense tensor as a plain ndarray view of the pack's in-memory copy of dense.bin
    (read-only, no copy, no ndarray subclass on the hot path)."""
    t = pack.dense(name)
    return PackedTensor(t.type, t.shape, np.asarray(t.data))


def _layer_weights(pack: Pack, layer: int, prefix: str) -> dict[str, PackedTensor]:
    """Every dense tensor of ``layer`` whose name starts with ``prefix``, keyed by the rest."""
    start = f"layers.{layer}.{prefix}"
    return {name[len(start):]: _dense(pack, name) for name in pack.manifest.dense_tensors if name.startswith(start)}


class Layer:
    def __init__(self, pack: Pack, layer: int, rotary: Rotary, experts: ExpertSource) -> None:
        c = pack.manifest.model
        self.eps = c.rms_norm_eps
        self.attn_norm = _dense(pack, f"layers.{layer}.attn_norm")
        self.ffn_norm = _dense(pack, f"layers.{layer}.ffn_norm")
        attn_weights = _layer_weights(pack, layer, "attn.")
        self.layer = layer
        if c.layer_mixer(layer) == "deltanet":
            self.attention = DeltaNet(c, layer, attn_weights, self.attn_norm)
        elif c.mla is not None:
            self.attention = LatentAttention(c, layer, attn_weights, self.attn_norm)
        else:
            self.attention = Attention(c, layer, attn_weights, rotary, self.attn_norm)
        ffn_weights = _layer_weights(pack, layer, "")
        self.ffn = MoeBlock(c, layer, ffn_weights, experts) if c.moe_layers[layer] else DenseMlp(ffn_weights)

    def __call__(self, x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, kv: SequenceCache) -> np.ndarray:
        """The residual stream x (T, D) after this layer; x itself may be updated in place."""
        if isinstance(self.attention, DeltaNet):
            # Until the per-layer sequence state lands, a sequence's DeltaNet states ride on its cache.
            states = kv.__dict__.setdefault("deltanet_states", {})
            state = states.setdefault(self.layer, self.attention.new_state(kv.max_tokens))
            x = self.attention.residual(x, positions, cos, sin, state, kv.length)
        else:
            x = self.attention.residual(x, positions, cos, sin, kv)
        x += self.ffn(rms_norm(x, self.ffn_norm, self.eps))
        return x


class Model:
    """Weights are read-only views into the pack; all mutable state lives in the sequence's
    cache (KVCache, or LatentCache for latent attention)."""

    def __init__(self, pack: Pack, experts: ExpertSource) -> None:
        self.pack = pack
        self.config = c = pack.manifest.model
        self.experts = experts
        self.rotary = Rotary(c.rope, c.rotated_dims)  # partial rotary: tables for the rotated dims only
        self.embed = _dense(pack, "embed")  # (V, D)
        self.lm_head = _dense(pack, "lm_head") if not c.tie_word_embeddings else self.embed  # (V, D)
        self.final_norm = _dense(pack, "final_norm")
        self.layers = [Layer(pack, layer, self.rotary, experts) for layer in range(c.num_layers)]
        moe_blocks = [layer.ffn for layer in self.layers if isinstance(layer.ffn, MoeBlock)]
        for block, next_block in zip(moe_blocks, moe_blocks[1:]):
            block.next_block = next_block  # lookahead prefetch: layer l predicts layer l+1's experts

    def embed_tokens(self, token_ids: np.ndarray) -> np.ndarray:
        if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= self.config.vocab_size):
            raise ValueError(f"token id out of range [0, {self.config.vocab_size})")
        if self.embed.type is native.TensorType.F32:
            return self.embed.data[token_ids].astype(np.float32)
        return native.get_rows(self.embed.type, self.embed.data, self.config.hidden_size, token_ids.astype(np.int32))

    def forward(self, token_ids: np.ndarray, kv: SequenceCache, all_logits: bool = True) -> np.ndarray:
        """Run ``token_ids`` (T,) after the tokens already in ``kv``; return logits
        (T, V), or (1, V) for the last token only when ``all_logits`` is False."""
        token_ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        positions = np.arange(kv.length, kv.length + token_ids.shape[0])
        cos, sin = self.rotary.cos_sin(positions)
        x = self.embed_tokens(token_ids)  # (T, D)
        for layer in self.layers:
            x = layer(x, positions, cos, sin, kv)
        kv.advance(token_ids.shape[0])
        if not all_logits:
            x = x[-1:]
        return linear(rms_norm(x, self.final_norm, self.config.rms_norm_eps), self.lm_head)
