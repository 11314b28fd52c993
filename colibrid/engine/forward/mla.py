"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) over the sequence's LatentCache.

The step runs as one libcolibri call (col_mla_block) in the absorbed form: the cache holds
each past token's normalised latent and rotated rope key (C + R floats), and kv_b's key and
value halves are folded into the query and the output instead of expanding per-head keys
and values. The numpy path below computes the expanded form instead (transformers' way:
per-head keys and values from every cached latent) and serves as its reference, and as the
fallback when q_a (or q) and kv_a have different types.
"""

from __future__ import annotations

import logging

import numpy as np

from colibrid import native
from colibrid.engine.forward.kv_cache import LatentCache
from colibrid.engine.forward.ops import linear, rms_norm
from colibrid.engine.forward.token_mixer import TokenMixer
from colibrid.models.model_config import ModelConfig
from colibrid.pack.tensor import PackedTensor

log = logging.getLogger(__name__)


def deinterleave(x: np.ndarray) -> np.ndarray:
    """(..., R) interleaved pairs (x0, x1), (x2, x3) ... -> evens then odds: rotate-half on
    this layout is DeepSeek's pairwise rotation (as libcolibri's rope_interleaved)."""
    return np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


class LatentAttention(TokenMixer):
    """One layer's latent-attention weights (with the input norm before it) and its step."""

    def __init__(self, config: ModelConfig, layer: int, weights: dict[str, PackedTensor], input_norm: PackedTensor) -> None:
        self.c = config
        self.m = config.mla
        self.layer = layer
        self.w = weights  # pack names without the "layers.{l}.attn." prefix
        self.input_norm = input_norm  # (D)
        self.fused = self._fused_layer()

    def _fused_layer(self) -> native.MlaLayer | None:
        c, m, w = self.c, self.m, self.w
        q_in = w["q_a"] if m.q_lora_rank else w["q"]
        if q_in.type != w["kv_a"].type:
            log.info("layer %d: q and kv_a have different types; latent attention runs in numpy", self.layer)
            return None
        matrices = {name: (t.type, t.data) for name, t in w.items() if len(t.shape) == 2}
        vectors = {name: w[name].data for name in ("q_a_norm", "kv_a_norm") if name in w}
        return native.mla_layer(c.hidden_size, c.num_heads, m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim,
                                m.qk_rope_head_dim, m.v_head_dim, self.input_norm.data, {**matrices, **vectors},
                                eps=c.rms_norm_eps, scale=m.softmax_scale, rope_interleaved=m.rope_interleaved,
                                bo=w["o_bias"].data if "o_bias" in w else None)

    def new_state(self, max_tokens: int, max_step_tokens: int, resumable: bool = False,
                  kv_dtype: type = np.float32) -> LatentCache:
        """A sequence's cache for this layer: C + R floats per token."""
        return LatentCache(self.m.kv_lora_rank + self.m.qk_rope_head_dim, max_tokens)

    def residual(self, x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                 cache: LatentCache, start: int) -> np.ndarray:
        """x + attention(rms_norm(x)) for tokens at ``positions`` = start ... after the ``start``
        tokens in ``cache``; ``x`` (T, D) is updated in place on the fused path."""
        if self.fused is not None:
            native.mla_block(self.fused, x, cos, sin, cache.buffers(start, x.shape[0]), start)
            return x
        return x + self.expanded(rms_norm(x, self.input_norm, self.c.rms_norm_eps), cos, sin, cache, start)

    def _rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """RoPE over the R rope dims of x (T, heads, R)."""
        if self.m.rope_interleaved:
            x = deinterleave(x)
        return native.rope(np.ascontiguousarray(x, dtype=np.float32), cos, sin)

    def expanded(self, h: np.ndarray, cos: np.ndarray, sin: np.ndarray, cache: LatentCache, start: int) -> np.ndarray:
        """attention(h) for normed inputs h (T, D) in the expanded form, the latents stored in
        the same cache as the fused path stores them."""
        c, m, w = self.c, self.m, self.w
        T, H, N, R, Vd, C = h.shape[0], c.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
        if m.q_lora_rank:
            q = linear(rms_norm(linear(h, w["q_a"]), w["q_a_norm"], c.rms_norm_eps), w["q_b"])
        else:
            q = linear(h, w["q"])
        q = q.reshape(T, H, N + R)  # (T, H, N + R)
        kv = linear(h, w["kv_a"])  # (T, C + R)
        buffer = cache.buffers(start, T)  # (capacity, L)
        buffer[start:start + T, :C] = rms_norm(kv[:, :C], w["kv_a_norm"], c.rms_norm_eps)
        buffer[start:start + T, C:] = self._rope(kv[:, None, C:], cos, sin)[:, 0]
        latents = buffer[: start + T]  # (S, L)
        S = latents.shape[0]
        kv_b = linear(latents[:, :C], w["kv_b"]).reshape(S, H, N + Vd)  # every past token's heads
        keys = np.concatenate([kv_b[..., :N], np.broadcast_to(latents[:, None, C:], (S, H, R))], axis=-1)
        query = np.concatenate([q[..., :N], self._rope(q[..., N:], cos, sin)], axis=-1)
        scores = np.einsum("thd,shd->hts", query, keys) * np.float32(m.softmax_scale)  # (H, T, S)
        visible = np.arange(S)[None, :] <= (start + np.arange(T))[:, None]  # (T, S) causal
        scores = np.where(visible[None], scores, -np.inf)
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        out = np.einsum("hts,shd->thd", p, kv_b[..., N:]).reshape(T, H * Vd).astype(np.float32)
        return linear(out, w["o"], w.get("o_bias"))
