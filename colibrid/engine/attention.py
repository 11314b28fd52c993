"""Grouped-query causal self-attention with RoPE, optional q/k RMSNorm, qkv clipping
and sliding windows; keys and values go through the sequence's KV cache."""

from __future__ import annotations

import numpy as np

from colibrid import native
from colibrid.engine.kv_cache import KVCache
from colibrid.engine.layers import linear, rms_norm
from colibrid.engine.rope import Rotary
from colibrid.models.config import ModelConfig
from colibrid.pack.tensor import PackedTensor


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
        q, k = native.rope(q, cos, sin), native.rope(k, cos, sin)
        keys, values = kv.append(self.layer, k, v)  # (S, K, Hd)
        # libcolibri, (token, head) pairs split across the pool; each query row is computed on
        # its own, so decode and prefill give the same numbers
        out = native.attention(q, keys, values, positions, self.window, float(self.scale))  # (T, H*Hd)
        return linear(out, w["o"], w.get("o_bias"))
