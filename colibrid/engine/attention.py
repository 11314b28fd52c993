"""Grouped-query causal self-attention with RoPE, optional q/k RMSNorm, qkv clipping
and sliding windows; keys and values go through the sequence's KV cache."""

from __future__ import annotations

import numpy as np

from colibrid.engine.kv_cache import KVCache
from colibrid.engine.layers import linear, rms_norm, softmax
from colibrid.engine.rope import Rotary
from colibrid.models.config import ModelConfig
from colibrid.pack.tensor import PackedTensor


def attention_mask(positions: np.ndarray, n_keys: int, window: int | None) -> np.ndarray:
    """(T, S) additive mask: key j is visible to query position p if j <= p (and p - j < window)."""
    keys = np.arange(n_keys)[None, :]
    visible = keys <= positions[:, None]
    if window:
        visible &= keys > positions[:, None] - window
    return np.where(visible, np.float32(0), np.float32(-np.inf))


class Attention:
    """One layer's attention weights and the forward step that uses them."""

    def __init__(self, config: ModelConfig, layer: int, weights: dict[str, PackedTensor], rotary: Rotary) -> None:
        self.c = config
        self.layer = layer
        self.w = weights  # pack names without the "layers.{l}.attn." prefix
        self.rotary = rotary
        self.window = config.sliding_window[layer]
        self.scale = np.float32(config.head_dim ** -0.5)

    def __call__(self, x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, kv: KVCache) -> np.ndarray:
        c, w = self.c, self.w
        T, H, K, Hd = x.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
        q = linear(x, w["q"], w.get("q_bias"))  # (T, H*Hd)
        k = linear(x, w["k"], w.get("k_bias"))  # (T, K*Hd)
        v = linear(x, w["v"], w.get("v_bias"))  # (T, K*Hd)
        if c.qk_norm == "full":
            q, k = rms_norm(q, w["q_norm"], c.rms_norm_eps), rms_norm(k, w["k_norm"], c.rms_norm_eps)
        if c.clip_qkv is not None:
            q, k, v = (np.clip(t, -c.clip_qkv, c.clip_qkv) for t in (q, k, v))
        q, k, v = q.reshape(T, H, Hd), k.reshape(T, K, Hd), v.reshape(T, K, Hd)
        if c.qk_norm == "head":
            q, k = rms_norm(q, w["q_norm"], c.rms_norm_eps), rms_norm(k, w["k_norm"], c.rms_norm_eps)
        q, k = Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin)
        keys, values = kv.append(self.layer, k, v)  # (S, K, Hd)
        out = self._attend(q, keys, values, positions)  # (T, H*Hd)
        return linear(out, w["o"], w.get("o_bias"))

    def _attend(self, q: np.ndarray, keys: np.ndarray, values: np.ndarray, positions: np.ndarray) -> np.ndarray:
        T, H, Hd = q.shape
        S, K = keys.shape[0], keys.shape[1]
        group = H // K  # query heads sharing one kv head
        qg = q.reshape(T, K, group, Hd).transpose(1, 2, 0, 3)  # (K, G, T, Hd)
        kt = keys.transpose(1, 2, 0)[:, None]  # (K, 1, Hd, S)
        scores = (qg @ kt) * self.scale  # (K, G, T, S)
        scores = scores + attention_mask(positions, S, self.window)
        probs = softmax(scores, axis=-1).astype(np.float32)
        out = probs @ values.transpose(1, 0, 2)[:, None]  # (K, G, T, Hd)
        return out.transpose(2, 0, 1, 3).reshape(T, H * Hd)
