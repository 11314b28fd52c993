"""What one sequence carries between steps: how many tokens it has processed and, per layer,
the state that layer's token mixer keeps (a KV cache, a ring of recent keys, latents, a
recurrent state ...). The model's weights hold no per-sequence state, so one model serves any
number of sequences: a step takes the sequence's state and advances it.

A layer state is a LayerState; its layer's mixer made it (``new_state``) and is the only code
that reads or writes it during a step. Layers that share a cache (KV sharing) hold the same
object, counted once.

Prefix reuse (engine/prefix_cache.py) asks two more things of a layer state: a compact copy of
what a finished sequence holds (``keep``, a LayerPrefix), and from which lengths a new
sequence whose tokens begin with the same ones may resume from that copy, with exactly the
numbers a fresh prefill of those tokens would have given it. A cache of every position (full
attention, latents) resumes at any length it holds; a ring only where the window before that
length is still in it; a recurrent state only where it was remembered (``note_prefill_chunk``).
A sequence resumes where every layer can (SequencePrefix).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


class LayerPrefix:
    """What a finished sequence's layer state keeps for reuse: a copy, owned by the prefix
    cache, from which a new sequence may resume at any length in resume_from .. resume_to."""

    resume_from: int
    resume_to: int

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    def restore(self, into: "LayerState", length: int) -> None:
        """Makes ``into``, a fresh state of the same layer (of any capacity), the state of a
        sequence that has processed the first ``length`` of the kept tokens."""
        raise NotImplementedError


class LayerState:
    """One layer's per-sequence state."""

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    def note_prefill_chunk(self, length: int) -> None:
        """The sequence has just processed exactly ``length`` tokens, the end of a whole prompt
        chunk: a fresh prefill of any longer prompt that begins with these tokens cuts here too,
        so its state here is this one. A state that cannot be cut back later (a recurrent
        one) remembers itself here if it was made resumable; a cache of positions needs nothing."""

    def kept_nbytes(self, length: int) -> int:
        """The size of keep(length), without making it (0: nothing to keep)."""
        raise NotImplementedError

    def keep(self, length: int) -> LayerPrefix | None:
        """What a later sequence can resume from of this state after ``length`` tokens, for
        prefix reuse; None when nothing of it can. Called once its sequence has ended, never
        to be written again: a state may hand over views of its own buffers."""
        raise NotImplementedError


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
        return sum(state.nbytes for state in self._unique().values())

    def _unique(self) -> dict[int, LayerState]:
        return {id(state): state for state in self.layers}

    # -- prefix reuse -------------------------------------------------------------------------

    def note_prefill_chunk(self) -> None:
        """A whole prompt chunk ends here (see LayerState.note_prefill_chunk)."""
        for state in self._unique().values():
            state.note_prefill_chunk(self.length)

    def kept_nbytes(self) -> int:
        """The size of keep()'s copy."""
        return sum(state.kept_nbytes(self.length) for state in self._unique().values())

    def keep(self) -> "SequencePrefix | None":
        """Every layer's kept part (LayerState.keep: the sequence has ended), for prefix
        reuse; None when there is no length at which every layer can resume."""
        kept: dict[int, LayerPrefix] = {}
        for key, state in self._unique().items():
            prefix = state.keep(self.length)
            if prefix is None:
                return None
            kept[key] = prefix
        resume_from = max(prefix.resume_from for prefix in kept.values())
        resume_to = min(prefix.resume_to for prefix in kept.values())
        if resume_to < max(resume_from, 1):
            return None
        return SequencePrefix([kept[id(state)] for state in self.layers], resume_from, resume_to)


@dataclass(frozen=True)
class SequencePrefix:
    """A finished sequence's kept state, every layer of it: a new sequence whose tokens begin
    with the kept ones may resume at any length in resume_from .. resume_to (each layer's
    range, intersected). Layers that shared a state share its prefix."""

    layers: list[LayerPrefix]
    resume_from: int
    resume_to: int

    @property
    def nbytes(self) -> int:
        return sum(prefix.nbytes for prefix in {id(p): p for p in self.layers}.values())

    def resume_length(self, most: int) -> int:
        """The longest length, at most ``most``, at which a sequence can resume; 0 if none."""
        length = min(most, self.resume_to)
        return length if length >= max(self.resume_from, 1) else 0

    def restore(self, into: SequenceState, length: int) -> None:
        """Makes ``into`` (a fresh state of the same model) hold the first ``length`` kept tokens."""
        if into.length != 0 or len(into.layers) != len(self.layers):
            raise ValueError("a prefix is restored into a fresh state of the same model")
        if not max(self.resume_from, 1) <= length <= self.resume_to or length > into.max_tokens:
            raise ValueError(f"cannot resume at {length} tokens (kept: {self.resume_from} .. {self.resume_to}, "
                             f"room for {into.max_tokens})")
        restored: set[int] = set()
        for prefix, state in zip(self.layers, into.layers):
            if id(state) not in restored:
                restored.add(id(state))
                prefix.restore(state, length)
        into.length = length
