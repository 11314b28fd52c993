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
``nbytes`` is known before the first step: the batch admits a sequence (Batch.has_room) only
when that fits in the KV budget, and a cache never grows (or copies itself) under a running batch. The
buffers come from np.empty: the kernel backs a page with memory only when a token is first
written to it, so a short chat in a long context costs its tokens, not the context.

For prefix reuse (engine/prefix_cache.py) a finished sequence's cache keeps a compact copy of
the positions it holds (PositionRows): every one for KVCache and LatentCache, the ring's last
rows for RingKVCache. Each position's row depends only on the tokens up to it, whatever step
wrote it (the kernels compute each row alone, a decode step's the same as a prefill's), so a
copy of positions 0 .. n-1 is what a fresh prefill of those n tokens writes. A ring's copy
serves only lengths whose window is still in it.
"""

from __future__ import annotations

import numpy as np

from colibrid.engine.forward.sequence_state import LayerPrefix, LayerState


class PositionRows(LayerPrefix):
    """A cache's kept rows: per position first .. first + n - 1, the row of each buffer
    (keys and values, or latents), in position order. With ``span`` (a window or chunk: the
    layer's queries see span - 1 keys back), a copy that starts after position 0 serves only
    the lengths whose window it holds."""

    def __init__(self, first: int, buffers: tuple[np.ndarray, ...], span: int | None) -> None:
        self.first = first
        self.buffers = buffers  # each (n, ...) of the cache's dtype
        n = buffers[0].shape[0]
        self.resume_from = 0 if first == 0 else first + span - 1
        self.resume_to = first + n

    @property
    def nbytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.buffers)

    def restore(self, into: LayerState, length: int) -> None:
        if not self.resume_from <= length <= self.resume_to:
            raise ValueError(f"these rows resume at {self.resume_from} .. {self.resume_to} tokens, not {length}")
        into.put_rows(self.first, tuple(buffer[: length - self.first] for buffer in self.buffers))


def _attend_over(rows: np.ndarray) -> np.ndarray:
    """A cache's rows as numpy attention reads them: float32 (a float16 cache's, converted exactly)."""
    return rows if rows.dtype == np.float32 else rows.astype(np.float32)


class KVCache(LayerState):
    """Keys and values of every past token of one layer, (max_tokens, K, Hd) of ``dtype``:
    float32, or float16 (kv_cache_type "f16": each key and value rounded to nearest even as it
    is stored; half the memory and half the reads)."""

    ring = False  # key position p is row p

    def __init__(self, num_kv_heads: int, head_dim: int, max_tokens: int, dtype: type = np.float32) -> None:
        self.max_tokens = max_tokens
        self._keys = np.empty((max_tokens, num_kv_heads, head_dim), dtype)  # (S, K, Hd)
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
        key_rows[start:end], value_rows[start:end] = keys, values  # numpy rounds to float16 as the kernels do
        return _attend_over(key_rows[:end]), _attend_over(value_rows[:end])

    @property
    def nbytes(self) -> int:
        return self._keys.nbytes + self._values.nbytes

    def kept_nbytes(self, length: int) -> int:
        return 2 * length * self._keys[0].nbytes

    def keep(self, length: int) -> PositionRows:
        # Views, not copies: the sequence has ended, and pages its reservation never wrote are
        # not resident, so handing the buffers over costs nothing (a copy stalled the batch).
        return PositionRows(0, (self._keys[:length], self._values[:length]), None)

    def put_rows(self, first: int, rows: tuple[np.ndarray, np.ndarray]) -> None:
        """Positions first .. of kept keys and values (prefix reuse)."""
        self.write(first, *rows)


class RingKVCache(LayerState):
    """The keys and values a sliding-window or chunked-local layer can still use: a ring of
    ``span + max_step_tokens - 1`` rows, key position p in row p % rows. A step of up to
    ``max_step_tokens`` new tokens writes its keys first and then attends; the ring is large
    enough that no key the step's first token sees has been overwritten by then. ``dtype`` as
    KVCache's."""

    ring = True

    def __init__(self, num_kv_heads: int, head_dim: int, span: int, max_step_tokens: int,
                 dtype: type = np.float32) -> None:
        self.max_step_tokens = max_step_tokens
        self.span = span  # a query sees span - 1 keys back at most
        self.rows = span + max_step_tokens - 1
        self._keys = np.zeros((self.rows, num_kv_heads, head_dim), dtype)  # (rows, K, Hd)
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
        return _attend_over(key_rows), _attend_over(value_rows)

    @property
    def nbytes(self) -> int:
        return self._keys.nbytes + self._values.nbytes

    def _held(self, length: int) -> tuple[int, np.ndarray]:
        """The first position the ring still holds after ``length`` tokens, and each held
        position's row, oldest first."""
        first = max(0, length - self.rows)
        return first, np.arange(first, length) % self.rows

    def kept_nbytes(self, length: int) -> int:
        return 2 * (length - self._held(length)[0]) * self._keys[0].nbytes

    def keep(self, length: int) -> PositionRows:
        first, rows = self._held(length)
        return PositionRows(first, (self._keys[rows], self._values[rows]), self.span)

    def put_rows(self, first: int, rows: tuple[np.ndarray, np.ndarray]) -> None:
        """Positions first .. of kept keys and values (prefix reuse): the ring takes the last
        of them that it holds."""
        keys, values = rows
        skip = max(0, keys.shape[0] - self.rows)
        index = np.arange(first + skip, first + keys.shape[0]) % self.rows
        self._keys[index], self._values[index] = keys[skip:], values[skip:]


class LatentCache(LayerState):
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

    def kept_nbytes(self, length: int) -> int:
        return length * self._latents[0].nbytes

    def keep(self, length: int) -> PositionRows:
        return PositionRows(0, (self._latents[:length],), None)  # a view, as KVCache.keep

    def put_rows(self, first: int, rows: tuple[np.ndarray]) -> None:
        """Positions first .. of kept latents (prefix reuse)."""
        (latents,) = rows
        self.buffers(first, latents.shape[0])[first:first + latents.shape[0]] = latents
