"""The transformer forward pass over a pack: embeddings, N x (token mixer, MoE or dense
MLP), final norm, output head. Knows features, never architecture names.

A layer's token mixer (attention, latent attention ...) makes the per-sequence state it needs
(``new_state``) and updates it in ``residual``; the model holds weights only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from colibrid import native
from colibrid.engine.forward.attention import Attention
from colibrid.engine.forward.deltanet import DeltaNet
from colibrid.engine.experts.source import ExpertSource
from colibrid.engine.forward.ops import linear, rms_norm
from colibrid.engine.forward.mla import LatentAttention
from colibrid.engine.forward.moe import LOOKAHEAD_PREDICTORS, DamageWatch, DenseAndExperts, DenseMlp, MoeBlock, RoutingStats
from colibrid.engine.forward.per_layer_inputs import LayerInput, PerLayerInputs
from colibrid.engine.forward.rope import Rotary
from colibrid.engine.routing_capture import RoutingCapture
from colibrid.engine.forward.sequence_state import SequenceState
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
        self.layer = layer
        self.eps = c.rms_norm_eps
        self.rotary = rotary  # this layer's RoPE (Gemma 4's full and sliding layers differ)
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
        if not c.moe_layers[layer]:
            self.ffn = DenseMlp(ffn_weights, c.hidden_act)
        elif c.dense_mlp_with_experts:
            self.ffn = DenseAndExperts(c, layer, ffn_weights, experts)  # its own input norms
        else:
            self.ffn = MoeBlock(c, layer, ffn_weights, experts)
        self.ffn_normed_inside = c.moe_layers[layer] and c.dense_mlp_with_experts
        self.ffn_post_norm = ffn_weights.get("ffn_post_norm")  # (D) Gemma: the FFN output normed
        self.input = LayerInput(c, ffn_weights) if c.per_layer_input else None
        self.scalar = ffn_weights["layer_scalar"].data if "layer_scalar" in ffn_weights else None  # (1)
        self.lookahead_on_residual = False  # the MoE block prefetches from the residual leaving the layer (Model sets it)

    @property
    def moe(self) -> MoeBlock | None:
        """This layer's routed experts, if it has any."""
        return self.ffn.moe if isinstance(self.ffn, DenseAndExperts) else self.ffn if isinstance(self.ffn, MoeBlock) else None

    def router_input_of(self, residual: np.ndarray) -> np.ndarray:
        """(T, D) what this layer's router would read for ``residual`` (T, D) had its token mixer
        added nothing: the pre-MoE norm of it, or itself where the router norms its own input."""
        if self.ffn_normed_inside:
            return np.ascontiguousarray(residual, dtype=np.float32)
        return rms_norm(residual, self.ffn_norm, self.eps)

    def feed_forward(self, x: np.ndarray, layer_input: np.ndarray | None = None) -> np.ndarray:
        """The residual stream x (T, D) after the layer's feed-forward half (MoE or MLP, the
        per-layer input, the layer scalar), for rows of any sequences: every op here is per
        row, and the MoE block runs each chosen expert once over all its rows. ``layer_input``
        (T, P): each row's per-layer input, with PLE. x may be updated in place."""
        out = self.ffn(x if self.ffn_normed_inside else rms_norm(x, self.ffn_norm, self.eps))
        x += out if self.ffn_post_norm is None else rms_norm(out, self.ffn_post_norm, self.eps)
        if self.input is not None:
            x += self.input.residual(x, layer_input)
        if self.scalar is not None:
            x *= self.scalar
        if self.lookahead_on_residual:  # the stream is final: guess the next MoE layer's experts from it
            self.moe.lookahead_from_residual(x)
        return x


# The most tokens one pass through the layers takes: longer inputs run in steps of this many, so
# a sliding-window layer's ring of keys needs only window + MAX_STEP_TOKENS - 1 rows.
MAX_STEP_TOKENS = 512

# kv_cache_type: what an attention layer's keys and values are stored as. "f16" halves their
# memory and reads; each is rounded to float16 as it is stored (as llama.cpp's default cache).
KV_CACHE_DTYPES = {"f32": np.float32, "f16": np.float16}


class Model:
    """Weights are read-only views into the pack; all mutable state lives in the sequence's
    SequenceState (new_state)."""

    def __init__(self, pack: Pack, experts: ExpertSource, lookahead_predictor: str = LOOKAHEAD_PREDICTORS[0],
                 kv_cache_type: str = "f32") -> None:
        if lookahead_predictor not in LOOKAHEAD_PREDICTORS:
            raise ValueError(f"lookahead_predictor must be one of {', '.join(LOOKAHEAD_PREDICTORS)}, "
                             f"got {lookahead_predictor!r:.40}")
        if kv_cache_type not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_type must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_type!r:.40}")
        self.kv_cache_type = kv_cache_type  # the element type of the attention layers' keys and values
        self.pack = pack
        self.config = c = pack.manifest.model
        self.experts = experts
        self.lookahead_predictor = lookahead_predictor
        self.rotary = Rotary(c.rope, c.rotated_dims)  # partial rotary: tables for the rotated dims only
        self.embed = _dense(pack, "embed")  # (V, D)
        self.lm_head = _dense(pack, "lm_head") if not c.tie_word_embeddings else self.embed  # (V, D)
        self.final_norm = _dense(pack, "final_norm")
        self._rotaries: dict[tuple, Rotary] = {}  # (RoPE, Hd) -> Rotary of the layers unlike the first
        self.layers = [Layer(pack, layer, self._rotary_of(layer), experts) for layer in range(c.num_layers)]
        self.per_layer_inputs = PerLayerInputs(c, _dense(pack, "per_layer_embed"), _dense(pack, "per_layer_model_proj"),
                                               _dense(pack, "per_layer_proj_norm")) if c.per_layer_input else None
        self.max_step_tokens = MAX_STEP_TOKENS  # states made by new_state() rely on it: set it before
        moe_blocks = [layer.moe for layer in self.layers if layer.moe is not None]
        self.routing_stats = RoutingStats()  # how much a batch's sequences share their experts
        self.damage_watch = DamageWatch(pack)  # damaged records a step met
        # What each MoE layer chose, recorded only while enabled (the routing stream, debug_routing)
        self.routing_capture = RoutingCapture([block.layer for block in moe_blocks], c.num_experts)
        for block in moe_blocks:
            block.stats = self.routing_stats
            block.damage = self.damage_watch
            block.capture = self.routing_capture
        moe_layers = [layer for layer in self.layers if layer.moe is not None]
        for layer, next_layer in zip(moe_layers, moe_layers[1:]):
            block = layer.moe  # lookahead prefetch: layer l predicts layer l+1's experts
            block.next_block, block.next_router_input = next_layer.moe, next_layer.router_input_of
            block.lookahead_predictor = lookahead_predictor
            layer.lookahead_on_residual = lookahead_predictor == "router-on-residual"

    def _rotary_of(self, layer: int) -> Rotary:
        """The model's one Rotary, or, where a layer's head width or RoPE differ from it
        (Gemma 4's full layers), one per distinct (RoPE, width) pair."""
        c = self.config
        if c.head_dim_of(layer) == c.head_dim and c.rope_of(layer) == c.rope:
            return self.rotary
        key = (c.rope_of(layer), c.head_dim_of(layer))
        if key not in self._rotaries:
            self._rotaries[key] = Rotary(*key)
        return self._rotaries[key]

    def embed_tokens(self, token_ids: np.ndarray) -> np.ndarray:
        if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= self.config.vocab_size):
            raise ValueError(f"token id out of range [0, {self.config.vocab_size})")
        if self.embed.type is native.TensorType.F32:
            x = self.embed.data[token_ids].astype(np.float32)
        else:
            x = native.get_rows(self.embed.type, self.embed.data, self.config.hidden_size, token_ids.astype(np.int32))
        if self.config.embed_scale != 1.0:
            x *= np.float32(self.config.embed_scale)  # Gemma: sqrt(D), in float32 as transformers scales it
        return x

    def new_state(self, max_tokens: int, resumable: bool = False) -> SequenceState:
        """A new sequence's state: each layer's cache for up to ``max_tokens`` tokens;
        ``resumable``: kept for prefix reuse when it ends (see SequenceState)."""
        kv_dtype = KV_CACHE_DTYPES[self.kv_cache_type]
        states = [layer.mixer.new_state(max_tokens, self.max_step_tokens, resumable, kv_dtype) for layer in self.layers]
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
        logits = [self.forward_batch([StepInput(state, ids, "all" if all_logits else ("last" if i == last else None))])[0]
                  for i, ids in enumerate(steps)]
        return np.concatenate([rows for rows in logits if rows is not None])

    def forward_batch(self, inputs: Sequence["StepInput"]) -> list[np.ndarray | None]:
        """One step over several sequences: each input's tokens run after those already in its
        state, through each layer's token mixer per sequence (each with its own state and
        positions) and through the feed-forward half once for all rows (each routed expert
        once per layer for the whole step). Returns each input's logits as it asks: (T, V)
        for "all", (1, V) for "last", None for None. Every row's numbers are the same as in a
        step of that sequence alone: the kernels compute each row on its own.
        StepDamaged if inputs were routed to expert records known to be damaged (it names
        them, and carries the others' logits).

        A sequence may appear at most once; each input has at most max_step_tokens tokens."""
        if len({id(item.state) for item in inputs}) != len(inputs):
            raise ValueError("a sequence may take part in a step only once")
        for item in inputs:
            if item.token_ids.shape[0] > self.max_step_tokens:
                raise ValueError(f"a step takes at most {self.max_step_tokens} tokens of a sequence")
            if item.state.length + item.token_ids.shape[0] > item.state.max_tokens:
                raise ValueError(f"context full: {item.state.length + item.token_ids.shape[0]} tokens > "
                                 f"{item.state.max_tokens}")
        counts = [item.token_ids.shape[0] for item in inputs]
        bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # (N + 1,) row offsets
        token_ids = np.concatenate([np.asarray(item.token_ids, dtype=np.int64) for item in inputs]) \
            if inputs else np.empty(0, np.int64)
        positions = np.concatenate([np.arange(item.state.length, item.state.length + n)
                                    for item, n in zip(inputs, counts)]) if inputs else np.empty(0, np.int64)
        x = self.embed_tokens(token_ids)  # (T, D) T: every row of the step
        per_layer = self.per_layer_inputs(token_ids, x) if self.per_layer_inputs is not None else None  # (T, L, P)
        tables = {}  # id(rotary) -> (cos, sin) of every row's position, each computed once
        self.routing_stats.begin_step(bounds)
        self.damage_watch.begin_step(bounds)
        capture = self.routing_capture
        capture.begin_step(bounds)
        for layer in self.layers:
            rotary = layer.rotary
            if id(rotary) not in tables:
                tables[id(rotary)] = rotary.cos_sin(positions)
            cos, sin = tables[id(rotary)]
            x = layer.mixer.residual_batch(x, bounds, positions, cos, sin,
                                           [item.state.layers[layer.layer] for item in inputs],
                                           [item.state.length for item in inputs])
            x = layer.feed_forward(x, None if per_layer is None else per_layer[:, layer.layer])
            if capture.enabled and capture.keep_hidden and layer.moe is not None:  # bench/predictor_study.py
                capture.record_hidden("residual", layer.layer, x)
        for item, n in zip(inputs, counts):
            item.state.advance(n)
        return self.damage_watch.end_step(self._logits(x, bounds, [item.logits for item in inputs]))

    def _logits(self, x: np.ndarray, bounds: np.ndarray, wanted: list[str | None]) -> list[np.ndarray | None]:
        """The output head over the rows each sequence wants ("all" its rows, its "last", or
        None), in one product for the whole step."""
        rows = [np.arange(bounds[i], bounds[i + 1]) if want == "all" else
                np.arange(bounds[i + 1] - 1, bounds[i + 1]) if want == "last" and bounds[i + 1] > bounds[i] else
                np.empty(0, np.int64) for i, want in enumerate(wanted)]
        picked = np.concatenate(rows) if rows else np.empty(0, np.int64)
        if picked.shape[0] == 0:  # nothing wanted, or only empty inputs: no product to run
            empty = np.empty((0, self.config.vocab_size), np.float32)
            return [None if want is None else empty for want in wanted]
        logits = linear(rms_norm(x[picked], self.final_norm, self.config.rms_norm_eps), self.lm_head)  # (n, V)
        cap = self.config.final_logit_softcap
        if cap:
            logits = np.tanh(logits / np.float32(cap)) * np.float32(cap)
        ends = np.cumsum([r.shape[0] for r in rows])
        return [None if want is None else logits[end - r.shape[0]:end]
                for want, r, end in zip(wanted, rows, ends)]


@dataclass(frozen=True)
class StepInput:
    """One sequence's part of a batched step (Model.forward_batch)."""

    state: SequenceState
    token_ids: np.ndarray  # (T,) int, the sequence's next tokens
    logits: str | None  # "all" (T, V), "last" (1, V), or None: what the step returns for it
