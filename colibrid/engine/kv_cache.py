"""One layer's attention cache, one kind per way a layer attends:

  KVCache      full causal attention: every past token's keys and values;
  RingKVCache  sliding-window or chunked-local attention: the keys and values a new token can
               still see, in a fixed ring of span + max_step_tokens - 1 rows (key position p in
               row p % rows), so a long chat costs the window, not the context;
  LatentCache  multi-head latent attention: the compressed latent and rope key per token.

Each is created by its layer's token mixer (Attention.new_state, LatentAttention.new_state)
and held in the sequence's SequenceState, one per layer: the sequence owns them, the layers
only read and write them during a step, so many sequences can share one model.

Every cache is allocated whole when the sequence starts, for the most tokens it may hold, so
``nbytes`` is known before the first step: the scheduler admits a sequence only when that fits
in the KV budget, and a cache never grows (or copies itself) under a running batch. The
buffers come from np.empty: the kernel backs a page with memory only when a token is first
written to it, so a short chat in a long context costs its tokens, not the context.
"""

from __future__ import annotations

import numpy as np


class KVCache:
    """Keys and values of every past token of one layer, float32 (max_tokens, K, Hd)."""

    ring = False  # key position p is row p

    def __init__(self, num_kv_heads: int, head_dim: int, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._keys = np.empty((max_tokens, num_kv_heads, head_dim), np.float32)  # (S, K, Hd)
        self._values = np.empty_like(self._keys)

    def buffers(self, start: int, n_new: int) -> tuple[np.ndarray, np.ndarray]:
        """The whole (max_tokens, K, Hd) key and value buffers, after checking that ``n_new``
        tokens fit after the first ``start`` (for libcolibri, which writes them in place)."""
        end = start + n_new
        if end > self.max_tokens:
            raise ValueError(f"context full: {end} tokens > {self.max_tokens}")
        return self._keys, self._values

    def write(self, start: int, keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store (T, K, Hd) keys/values at positions start ..; return the buffers to attend
        over: every key so far, (start + T, K, Hd)."""
        end = start + keys.shape[0]
        key_rows, value_rows = self.buffers(start, keys.shape[0])
        key_rows[start:end], value_rows[start:end] = keys, values
        return key_rows[:end], value_rows[:end]

    @property
    def nbytes(self) -> int:
        return self._keys.nbytes + self._values.nbytes


class RingKVCache:
    """The keys and values a sliding-window or chunked-local layer can still use: a ring of
    ``span + max_step_tokens - 1`` rows, key position p in row p % rows. A step of up to
    ``max_step_tokens`` new tokens writes its keys first and then attends; the ring is large
    enough that no key the step's first token sees has been overwritten by then."""

    ring = True

    def __init__(self, num_kv_heads: int, head_dim: int, span: int, max_step_tokens: int) -> None:
        self.max_step_tokens = max_step_tokens
        self.rows = span + max_step_tokens - 1
        self._keys = np.zeros((self.rows, num_kv_heads, head_dim), np.float32)  # (rows, K, Hd)
        self._values = np.zeros_like(self._keys)

    def buffers(self, start: int, n_new: int) -> tuple[np.ndarray, np.ndarray]:
        """The whole ring (rows, K, Hd) for libcolibri, which writes and reads it in place."""
        if n_new > self.max_step_tokens:
            raise ValueError(f"a step of {n_new} tokens is more than this ring holds ({self.max_step_tokens})")
        return self._keys, self._values

    def write(self, start: int, keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store (T, K, Hd) keys/values at positions start ..; return the whole ring to attend
        over (with ring=True)."""
        key_rows, value_rows = self.buffers(start, keys.shape[0])
        rows = np.arange(start, start + keys.shape[0]) % self.rows
        key_rows[rows], value_rows[rows] = keys, values
        return key_rows, value_rows

    @property
    def nbytes(self) -> int:
        return self._keys.nbytes + self._values.nbytes


class LatentCache:
    """Multi-head latent attention's cache for one layer: per past token the normalised latent
    and the rotated rope key, C + R float32 (576 for DeepSeek-V3), instead of every head's key
    and value (H * (N + R + Vd) = 40960 for V3). buffers() gives the whole (max_tokens, L)
    buffer for libcolibri to write in place."""

    def __init__(self, width: int, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._latents = np.empty((max_tokens, width), np.float32)  # (S, L)

    def buffers(self, start: int, n_new: int) -> np.ndarray:
        """The whole (max_tokens, L) buffer, after checking that ``n_new`` tokens fit after the first ``start``."""
        end = start + n_new
        if end > self.max_tokens:
            raise ValueError(f"context full: {end} tokens > {self.max_tokens}")
        return self._latents

    @property
    def nbytes(self) -> int:
        return self._latents.nbytes
