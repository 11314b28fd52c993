"""What a layer's token mixer (attention, latent attention, Gated DeltaNet ...) offers the
model: it makes the per-sequence state it needs and moves the residual stream of new tokens
through itself, reading and writing only that state.

A batched step (Model.forward_batch) hands a mixer the rows of several sequences at once.
The default runs them one sequence at a time; a mixer whose weight products can serve every
row in one pass (full and windowed attention, in one libcolibri call) overrides
residual_batch, so a batch of decode steps reads its weights once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from colibrid.engine.forward.sequence_state import LayerState


class TokenMixer:
    def new_state(self, max_tokens: int, max_step_tokens: int, resumable: bool = False,
                  kv_dtype: type = np.float32) -> LayerState:
        """A fresh sequence's state for this layer, for up to ``max_tokens`` tokens fed at
        most ``max_step_tokens`` at a time; ``resumable``: one that prefix reuse can resume
        from later (only a recurrent state needs more memory for that, see DeltaNetState);
        ``kv_dtype``: the element type of an attention layer's keys and values (float32 or
        float16; latent and recurrent states stay float32)."""
        raise NotImplementedError

    def residual(self, x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                 state: LayerState, start: int) -> np.ndarray:
        """x (T, D) plus this mixer's output for the next T tokens of one sequence, whose
        state is ``state`` and which holds ``start`` tokens before them; x may be updated in place."""
        raise NotImplementedError

    def residual_batch(self, x: np.ndarray, bounds: np.ndarray, positions: np.ndarray, cos: np.ndarray,
                       sin: np.ndarray, states: Sequence[LayerState], starts: Sequence[int]) -> np.ndarray:
        """``residual`` over the rows of several sequences: sequence i has rows bounds[i] ..
        bounds[i + 1] of x (T, D), its state states[i] and starts[i] tokens before them.
        Every row gets the numbers it gets in a step of its sequence alone."""
        for i, (state, start) in enumerate(zip(states, starts)):
            a, b = bounds[i], bounds[i + 1]
            if a < b:
                x[a:b] = self.residual(x[a:b], positions[a:b], cos[a:b], sin[a:b], state, start)
        return x
