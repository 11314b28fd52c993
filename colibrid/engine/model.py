"""The transformer forward pass over a pack: embeddings, N x (token mixer, MoE or dense
MLP), final norm, output head. Knows features, never architecture names.

A layer's token mixer (attention, latent attention ...) makes the per-sequence state it needs
(``new_state``) and updates it in ``residual``; the model holds weights only.
"""

from __future__ import annotations

import numpy as np

from colibrid import native
from colibrid.engine.attention import Attention
from colibrid.engine.deltanet import DeltaNet
from colibrid.engine.experts import ExpertSource
from colibrid.engine.layers import linear, rms_norm
from colibrid.engine.mla import LatentAttention
from colibrid.engine.moe import DenseMlp, MoeBlock
from colibrid.engine.rope import Rotary
from colibrid.engine.sequence_state import LayerState, SequenceState
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
        if c.layer_mixer(layer) == "deltanet":
            self.mixer = DeltaNet(c, layer, attn_weights, self.attn_norm)
        elif c.mla is not None:
            self.mixer = LatentAttention(c, layer, attn_weights, self.attn_norm)
        else:
            self.mixer = Attention(c, layer, attn_weights, rotary, self.attn_norm)
        ffn_weights = _layer_weights(pack, layer, "")
        self.ffn = MoeBlock(c, layer, ffn_weights, experts) if c.moe_layers[layer] else DenseMlp(ffn_weights)

    def __call__(self, x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, state: LayerState,
                 start: int) -> np.ndarray:
        """The residual stream x (T, D) after this layer, for tokens after the first ``start``
        of the sequence whose state for this layer is ``state``; x may be updated in place."""
        x = self.mixer.residual(x, positions, cos, sin, state, start)
        x += self.ffn(rms_norm(x, self.ffn_norm, self.eps))
        return x


# The most tokens one pass through the layers takes: longer inputs run in steps of this many, so
# a sliding-window layer's ring of keys needs only window + MAX_STEP_TOKENS - 1 rows.
MAX_STEP_TOKENS = 512


class Model:
    """Weights are read-only views into the pack; all mutable state lives in the sequence's
    SequenceState (new_state)."""

    def __init__(self, pack: Pack, experts: ExpertSource) -> None:
        self.pack = pack
        self.config = c = pack.manifest.model
        self.experts = experts
        self.rotary = Rotary(c.rope, c.rotated_dims)  # partial rotary: tables for the rotated dims only
        self.embed = _dense(pack, "embed")  # (V, D)
        self.lm_head = _dense(pack, "lm_head") if not c.tie_word_embeddings else self.embed  # (V, D)
        self.final_norm = _dense(pack, "final_norm")
        self.layers = [Layer(pack, layer, self.rotary, experts) for layer in range(c.num_layers)]
        self.max_step_tokens = MAX_STEP_TOKENS  # states made by new_state() rely on it: set it before
        moe_blocks = [layer.ffn for layer in self.layers if isinstance(layer.ffn, MoeBlock)]
        for block, next_block in zip(moe_blocks, moe_blocks[1:]):
            block.next_block = next_block  # lookahead prefetch: layer l predicts layer l+1's experts

    def embed_tokens(self, token_ids: np.ndarray) -> np.ndarray:
        if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= self.config.vocab_size):
            raise ValueError(f"token id out of range [0, {self.config.vocab_size})")
        if self.embed.type is native.TensorType.F32:
            return self.embed.data[token_ids].astype(np.float32)
        return native.get_rows(self.embed.type, self.embed.data, self.config.hidden_size, token_ids.astype(np.int32))

    def new_state(self, max_tokens: int) -> SequenceState:
        """A new sequence's state: each layer's cache for up to ``max_tokens`` tokens."""
        states = [layer.mixer.new_state(max_tokens, self.max_step_tokens) for layer in self.layers]
        return SequenceState(states, max_tokens)

    def forward(self, token_ids: np.ndarray, state: SequenceState, all_logits: bool = True) -> np.ndarray:
        """Run ``token_ids`` (T,) after the tokens already in ``state``; return logits
        (T, V), or (1, V) for the last token only when ``all_logits`` is False. Inputs longer
        than max_step_tokens run in steps (each token's numbers do not depend on its step)."""
        token_ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if state.length + token_ids.shape[0] > state.max_tokens:
            raise ValueError(f"context full: {state.length + token_ids.shape[0]} tokens > {state.max_tokens}")
        size = self.max_step_tokens
        steps = [token_ids[i:i + size] for i in range(0, max(token_ids.shape[0], 1), size)]
        last = len(steps) - 1
        logits = [self._step(ids, state, "all" if all_logits else ("last" if i == last else None))
                  for i, ids in enumerate(steps)]
        return np.concatenate([rows for rows in logits if rows is not None])

    def _step(self, token_ids: np.ndarray, state: SequenceState, logits: str | None) -> np.ndarray | None:
        """One pass of at most max_step_tokens tokens; logits of "all" of them, the "last", or None."""
        start = state.length
        positions = np.arange(start, start + token_ids.shape[0])
        cos, sin = self.rotary.cos_sin(positions)
        x = self.embed_tokens(token_ids)  # (T, D)
        for layer, layer_state in zip(self.layers, state.layers):
            x = layer(x, positions, cos, sin, layer_state, start)
        state.advance(token_ids.shape[0])
        if logits is None:
            return None
        if logits == "last":
            x = x[-1:]
        return linear(rms_norm(x, self.final_norm, self.config.rms_norm_eps), self.lm_head)
