"""Per-sequence attention caches, one growable buffer per layer: keys and values
(KVCache) or, for latent attention, the compressed latents (LatentCache). Both have one
interface (length, buffers, advance, nbytes), so a session holds whichever its model needs."""

from __future__ import annotations

import numpy as np

from colibrid.models.config import ModelConfig


class KVCache:
    """Keys and values of every past token, per layer, in float32.

    Buffers grow by doubling up to ``max_tokens``, so a short chat does not reserve
    the model's whole context.
    """

    def __init__(self, config: ModelConfig, max_tokens: int, initial_tokens: int = 256) -> None:
        self.max_tokens = max_tokens
        self.length = 0  # tokens stored (the same for every layer after a full forward)
        capacity = min(initial_tokens, max_tokens)
        shapes = [(capacity, config.kv_heads_of(layer), config.head_dim_of(layer)) for layer in range(config.num_layers)]
        self._keys = [np.empty(shape, np.float32) for shape in shapes]  # (S, K, Hd) per layer
        self._values = [np.empty(shape, np.float32) for shape in shapes]

    def append(self, layer: int, keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store (T, K, Hd) keys/values after the current length; return all (S, K, Hd) so far."""
        start, end = self.length, self.length + keys.shape[0]
        self.buffers(layer, keys.shape[0])
        self._keys[layer][start:end] = keys
        self._values[layer][start:end] = values
        return self._keys[layer][:end], self._values[layer][:end]

    def buffers(self, layer: int, n_new: int) -> tuple[np.ndarray, np.ndarray]:
        """The layer's whole (capacity, K, Hd) key and value buffers, grown to hold ``n_new``
        tokens after the current length (for libcolibri, which writes them in place)."""
        end = self.length + n_new
        if end > self.max_tokens:
            raise ValueError(f"context full: {end} tokens > {self.max_tokens}")
        if end > self._keys[layer].shape[0]:
            self._grow(layer, end)
        return self._keys[layer], self._values[layer]

    def advance(self, n_tokens: int) -> None:
        """Commit ``n_tokens`` appended to every layer."""
        self.length += n_tokens

    def _grow(self, layer: int, needed: int) -> None:
        capacity = self._keys[layer].shape[0]
        while capacity < needed:
            capacity *= 2
        capacity = min(capacity, self.max_tokens)
        for buffers in (self._keys, self._values):
            old = buffers[layer]
            new = np.empty((capacity,) + old.shape[1:], np.float32)
            new[: self.length] = old[: self.length]
            buffers[layer] = new

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self._keys, self._values))


class LatentCache:
    """Multi-head latent attention's cache: per layer and past token the normalised latent and
    the rotated rope key, C + R float32 (576 for DeepSeek-V3), instead of every head's key
    and value (H * (N + R + Vd) = 40960 for V3). Same interface as KVCache: buffers() gives
    the layer's whole buffer for libcolibri to write in place, advance() commits a step."""

    def __init__(self, config: ModelConfig, max_tokens: int, initial_tokens: int = 256) -> None:
        self.max_tokens = max_tokens
        self.length = 0  # tokens stored (the same for every layer after a full forward)
        m = config.mla
        capacity = min(initial_tokens, max_tokens)
        width = m.kv_lora_rank + m.qk_rope_head_dim  # L
        self._latents = [np.empty((capacity, width), np.float32) for _ in range(config.num_layers)]  # (S, L)

    def buffers(self, layer: int, n_new: int) -> np.ndarray:
        """The layer's whole (capacity, L) buffer, grown to hold ``n_new`` tokens after the
        current length."""
        end = self.length + n_new
        if end > self.max_tokens:
            raise ValueError(f"context full: {end} tokens > {self.max_tokens}")
        if end > self._latents[layer].shape[0]:
            capacity = self._latents[layer].shape[0]
            while capacity < end:
                capacity *= 2
            new = np.empty((min(capacity, self.max_tokens), self._latents[layer].shape[1]), np.float32)
            new[: self.length] = self._latents[layer][: self.length]
            self._latents[layer] = new
        return self._latents[layer]

    def advance(self, n_tokens: int) -> None:
        """Commit ``n_tokens`` appended to every layer."""
        self.length += n_tokens

    @property
    def nbytes(self) -> int:
        return sum(buffer.nbytes for buffer in self._latents)


SequenceCache = KVCache | LatentCache  # what Model.forward takes: a sequence's attention state


def new_cache(config: ModelConfig, max_tokens: int) -> SequenceCache:
    """The cache a sequence of this model keeps: latents for latent attention, else keys and values."""
    return LatentCache(config, max_tokens) if config.mla is not None else KVCache(config, max_tokens)
