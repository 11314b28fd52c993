"""Grouped-query causal self-attention with RoPE (optionally partial: the leading dims of
each head only; or on interleaved pairs; or none, on NoPE layers), optional q/k RMSNorm
(before RoPE, or Llama 4's unweighted one after it), qkv clipping, sliding windows, per-head
sink logits, attention temperature tuning and an output gate; Gemma 4's v norm, values taken
from the keys' projection, and a norm of the output before the residual add; keys and values
go through the sequence's KV cache."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from colibrid import native
from colibrid.engine.forward.kv_cache import KVCache, RingKVCache
from colibrid.engine.forward.ops import linear, rms_norm
from colibrid.engine.forward.rope import Rotary
from colibrid.engine.forward.token_mixer import TokenMixer
from colibrid.models.model_config import ModelConfig
from colibrid.pack.tensor import PackedTensor

log = logging.getLogger(__name__)


class Attention(TokenMixer):
    """One layer's attention weights (with the input norm before it) and the forward step
    that uses them."""

    def __init__(self, config: ModelConfig, layer: int, weights: dict[str, PackedTensor], rotary: Rotary,
                 input_norm: PackedTensor) -> None:
        self.c = config
        self.layer = layer
        self.w = weights  # pack names without the "layers.{l}.attn." prefix
        self.rotary = rotary
        self.input_norm = input_norm  # (D)
        self.window = config.sliding_window[layer]
        self.chunk = config.attention_chunk[layer] if config.attention_chunk else None  # Llama 4
        self.head_dim, self.kv_heads = config.head_dim_of(layer), config.kv_heads_of(layer)  # Hd, K of this layer
        self.scale = np.float32(config.attention_scale or self.head_dim ** -0.5)
        # Gemma 4: without a v projection the values are the k projection, before the k norm
        self.wv = weights["v"] if config.has_v_projection(layer) else weights["k"]
        self.v_norm = np.ones(self.head_dim, np.float32) if config.v_norm else None  # (Hd) a norm without weight
        self.post_norm = weights["post_norm"] if "post_norm" in weights else None  # (D)
        self.no_rope = config.is_nope(layer)
        self.qk_norm, self.q_norm, self.k_norm = self._qk_norm()
        # Llama 4 tunes the temperature of the NoPE layers only, whose queries know no position
        self.temperature = (config.attn_temperature_floor, config.attn_temperature_scale) \
            if self.no_rope and config.attn_temperature_floor > 0 else None
        self.fused = self._fused_layer()

    def _qk_norm(self) -> tuple[str, np.ndarray | None, np.ndarray | None]:
        """(kind, q weight, k weight) as libcolibri names them: Llama 4's "l2" is a per-head
        RMSNorm after RoPE with weights of ones, on the layers with RoPE only."""
        c, w = self.c, self.w
        if c.qk_norm == "l2":
            if self.no_rope:
                return "none", None, None
            ones = np.ones(self.head_dim, np.float32)
            return "head_after_rope", ones, ones
        if c.qk_norm == "none":
            return "none", None, None
        return c.qk_norm, w["q_norm"].data, w["k_norm"].data

    def _fused_layer(self) -> native.AttentionLayer | None:
        """The whole step as one libcolibri call (col_attention_block, the same numbers as the
        numpy path below), or None where it does not apply: q, k and v of different types."""
        c, w = self.c, self.w
        if len({w[name].type for name in ("q", "k", "gate") if name in w} | {self.wv.type}) != 1:
            log.info("layer %d: q, k, v (and gate) have different types; attention runs step by step", self.layer)
            return None
        bias = lambda name: w[name].data if name in w else None  # noqa: E731
        return native.attention_layer(
            c.hidden_size, c.num_heads, self.kv_heads, self.head_dim, self.input_norm.data, w["q"].type,
            w["q"].data, w["k"].data, self.wv.data, w["o"].type, w["o"].data, eps=c.rms_norm_eps,
            scale=float(self.scale), window=self.window, clip_qkv=c.clip_qkv, qk_norm=self.qk_norm,
            q_norm=self.q_norm, k_norm=self.k_norm, bq=bias("q_bias"), bk=bias("k_bias"), bv=bias("v_bias"),
            bo=bias("o_bias"), rotary_dim=c.rotary_dim, sinks=bias("sinks"), rope_interleaved=c.rope_interleaved,
            no_rope=self.no_rope, temperature=self.temperature, chunk=self.chunk,
            wg=w["gate"].data if "gate" in w else None, v_norm=self.v_norm,
            post_norm=None if self.post_norm is None else self.post_norm.data)

    def new_state(self, max_tokens: int, max_step_tokens: int, resumable: bool = False,
                  kv_dtype: type = np.float32) -> KVCache | RingKVCache:
        """A sequence's cache for this layer, of ``kv_dtype`` values: a ring of the keys a
        window or chunk can still see, when that is smaller than the whole context; else every key."""
        spans = [span for span in (self.window, self.chunk) if span]
        if spans and min(spans) + max_step_tokens - 1 < max_tokens:
            return RingKVCache(self.kv_heads, self.head_dim, min(spans), max_step_tokens, kv_dtype)
        return KVCache(self.kv_heads, self.head_dim, max_tokens, kv_dtype)

    def residual(self, x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                 kv: KVCache | RingKVCache, start: int) -> np.ndarray:
        """x + attention(rms_norm(x)) for tokens at ``positions`` = start, start + 1 ... after
        the ``start`` tokens in ``kv``; ``x`` (T, D) is updated in place on the fused path."""
        if self.fused is not None:
            keys, values = kv.buffers(start, x.shape[0])
            native.attention_block(self.fused, x, cos, sin, keys, values, start, ring=kv.ring)
            return x
        out = self(rms_norm(x, self.input_norm, self.c.rms_norm_eps), positions, cos, sin, kv, start)
        return x + (out if self.post_norm is None else rms_norm(out, self.post_norm, self.c.rms_norm_eps))

    def residual_batch(self, x: np.ndarray, bounds: np.ndarray, positions: np.ndarray, cos: np.ndarray,
                       sin: np.ndarray, states: Sequence[KVCache | RingKVCache], starts: Sequence[int]) -> np.ndarray:
        """The rows of several sequences in one libcolibri call: the q/k/v and output products
        read the layer's weights once for all of them (see TokenMixer.residual_batch)."""
        if self.fused is None:
            return super().residual_batch(x, bounds, positions, cos, sin, states, starts)
        counts = np.diff(bounds)
        caches = [(*kv.buffers(start, int(n)), start, int(n), kv.ring) for kv, start, n in zip(states, starts, counts)]
        native.attention_block_batch(self.fused, x, cos, sin, caches)
        return x

    def __call__(self, x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                 kv: KVCache | RingKVCache, start: int) -> np.ndarray:
        c, w = self.c, self.w
        if "sinks" in w:
            raise NotImplementedError(f"layer {self.layer}: attention sinks are computed by the fused attention step only, "
                                      "which needs q, k and v of one type (as the converter writes them)")
        T, H, K, Hd = x.shape[0], c.num_heads, self.kv_heads, self.head_dim
        q = linear(x, w["q"], w.get("q_bias"))  # (T, H*Hd)
        k = linear(x, w["k"], w.get("k_bias"))  # (T, K*Hd)
        v = linear(x, self.wv, w.get("v_bias"))  # (T, K*Hd)
        if self.qk_norm == "full":
            q, k = native.rms_norm(q, self.q_norm, c.rms_norm_eps), native.rms_norm(k, self.k_norm, c.rms_norm_eps)
        if c.clip_qkv is not None:
            q, k, v = (np.clip(t, -c.clip_qkv, c.clip_qkv) for t in (q, k, v))
        q, k, v = q.reshape(T, H, Hd), k.reshape(T, K, Hd), v.reshape(T, K, Hd)
        if self.qk_norm == "head":
            q, k = native.rms_norm(q, self.q_norm, c.rms_norm_eps), native.rms_norm(k, self.k_norm, c.rms_norm_eps)
        if self.v_norm is not None:
            v = native.rms_norm(v, self.v_norm, c.rms_norm_eps)
        if not self.no_rope:
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        if self.qk_norm == "head_after_rope":
            q, k = native.rms_norm(q, self.q_norm, c.rms_norm_eps), native.rms_norm(k, self.k_norm, c.rms_norm_eps)
        if self.temperature is not None:
            q = q * temperature_gain(positions, *self.temperature)[:, None, None]
        keys, values = kv.write(start, k, v)  # (S or ring rows, K, Hd)
        # libcolibri, (token, head) pairs split across the pool; each query row is computed on
        # its own, so decode and prefill give the same numbers
        out = native.attention(q, keys, values, positions, self.window, float(self.scale), chunk=self.chunk,
                               ring=kv.ring)  # (T, H*Hd)
        if "gate" in w:  # the output gate (Qwen3.5, Qwen3-Next): per head and dim, sigmoid of its own projection
            with np.errstate(over="ignore"):
                out = out * (np.float32(1.0) / (np.float32(1.0) + np.exp(-linear(x, w["gate"]))))
        return linear(out.astype(np.float32), w["o"], w.get("o_bias"))

    def _rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """RoPE over x (T, heads, Hd): rotate-half, or on interleaved pairs (de-interleaved,
        rotated, interleaved again: the arithmetic of libcolibri's pair rotation)."""
        if not self.c.rope_interleaved:
            return native.rope(x, cos, sin)
        Hr = cos.shape[1]
        pairs = np.concatenate([x[..., 0:Hr:2], x[..., 1:Hr:2], x[..., Hr:]], axis=-1)
        turned = native.rope(np.ascontiguousarray(pairs), cos, sin)
        out = np.array(x, dtype=np.float32, copy=True)
        out[..., 0:Hr:2], out[..., 1:Hr:2] = turned[..., : Hr // 2], turned[..., Hr // 2 : Hr]
        return out


def temperature_gain(positions: np.ndarray, floor: int, scale: float) -> np.ndarray:
    """(T,) float32 factors of attention temperature tuning for the queries at ``positions``:
    log1p(floor((p + 1) / floor)) * scale + 1, in float32 as transformers computes them."""
    f32 = np.float32
    p = positions.astype(f32)
    return (np.log1p(np.floor((p + f32(1)) / f32(floor))) * f32(scale) + f32(1)).astype(f32)
