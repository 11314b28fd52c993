"""What one sequence carries between steps: how many tokens it has processed and, per layer,
the state that layer's token mixer keeps (a KV cache, a ring of recent keys, latents, a
recurrent state ...). The model's weights hold no per-sequence state, so one model serves any
number of sequences: a step takes the sequence's state and advances it.

A layer state is any object with ``nbytes``; its layer's mixer made it (``new_state``) and is
the only code that reads or writes it. Layers that share a cache (KV sharing) hold the same
object, counted once.
"""

from __future__ import annotations

from typing import Protocol, Sequence


class LayerState(Protocol):
    @property
    def nbytes(self) -> int: ...


class SequenceState:
    def __init__(self, layers: Sequence[LayerState], max_tokens: int) -> None:
        self.layers = list(layers)  # one per layer
        self.max_tokens = max_tokens
        self.length = 0  # tokens processed: the position of the next token

    def advance(self, n_tokens: int) -> None:
        """Commit a step of ``n_tokens`` that every layer has processed."""
        self.length += n_tokens

    @property
    def nbytes(self) -> int:
        unique = {id(state): state for state in self.layers}
        return sum(state.nbytes for state in unique.values())
