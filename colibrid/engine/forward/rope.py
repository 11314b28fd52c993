"""Rotary position embeddings (rotate-half convention), computed as transformers does:
inverse frequencies in float32, cos/sin of position x inv_freq in float32."""

from __future__ import annotations

import math

import numpy as np

from colibrid.models.model_config import RopeConfig


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> tuple[np.ndarray, float]:
    base, factor = rope.theta, rope.factor
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)

    def correction_dim(rotations: float) -> float:
        original = rope.original_max_position_embeddings
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero, as the reference does
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation_factor = np.float32(1) - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    attention = rope.attention_factor
    if attention is None:
        attention = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv_freq.astype(np.float32), float(attention)


def _llama3_inv_freq(rope: RopeConfig, inv_freq: np.ndarray) -> np.ndarray:
    """Llama 3.1's (and Llama 4's) frequency scaling, in float32 as transformers computes it:
    long wavelengths divided by the factor, short ones kept, a smooth blend between."""
    f32 = np.float32
    original, factor = rope.original_max_position_embeddings, f32(rope.factor)
    low_freq_wavelen, high_freq_wavelen = original / rope.low_freq_factor, original / rope.high_freq_factor
    wavelen = f32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > f32(low_freq_wavelen), inv_freq / factor, inv_freq).astype(f32)
    with np.errstate(divide="ignore", invalid="ignore"):  # equal factors (Scout): no medium band, the NaNs unused
        smooth = (f32(original) / wavelen - f32(rope.low_freq_factor)) / f32(rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (f32(1) - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < f32(high_freq_wavelen)) & ~(wavelen > f32(low_freq_wavelen))
    return np.where(medium, smoothed, scaled).astype(f32)


def _proportional_inv_freq(rope: RopeConfig, dim: int) -> np.ndarray:
    """Gemma 4's proportional RoPE over a whole head of ``dim``: the first int(p * dim / 2) pairs
    rotate with exponents over dim (not over the rotated dims, as partial rotary has it), the
    others with frequency 0: cos 1 and sin 0 leave them as they are, exactly."""
    angles = int(rope.partial_rotary_factor * dim // 2)
    rotated = np.float32(1.0) / (np.float32(rope.theta) ** (np.arange(0, 2 * angles, 2, dtype=np.float32) / np.float32(dim)))
    inv_freq = np.concatenate([rotated, np.zeros(dim // 2 - angles, np.float32)])
    return (inv_freq / np.float32(rope.factor)).astype(np.float32)


class Rotary:
    """cos/sin tables for the rotated dims of a head: all Hd, or the leading Hr with partial
    rotary (whose frequencies transformers computes over Hr, as here)."""

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        self.head_dim = head_dim  # Hd, or Hr with partial rotary
        if rope.type == "yarn":
            self.inv_freq, self.scale = _yarn_inv_freq(rope, head_dim)
        elif rope.type == "proportional":
            self.inv_freq, self.scale = _proportional_inv_freq(rope, head_dim), 1.0
        else:
            exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
            self.inv_freq = (np.float32(1.0) / (np.float32(rope.theta) ** exponents)).astype(np.float32)  # (Hd/2,)
            if rope.type == "linear":
                self.inv_freq = (self.inv_freq / np.float32(rope.factor)).astype(np.float32)
            elif rope.type == "llama3":
                self.inv_freq = _llama3_inv_freq(rope, self.inv_freq)
            self.scale = 1.0

    def cos_sin(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(T, Hd) cos and sin for integer positions (T,)."""
        freqs = positions.astype(np.float32)[:, None] * self.inv_freq[None, :]  # (T, Hd/2)
        emb = np.concatenate([freqs, freqs], axis=-1)
        cos = np.cos(emb) * np.float32(self.scale)
        sin = np.sin(emb) * np.float32(self.scale)
        return cos.astype(np.float32), sin.astype(np.float32)

    @staticmethod
    def apply(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """Rotate x (T, heads, Hd) by per-token cos/sin (T, Hd)."""
        half = x.shape[-1] // 2
        rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]
