"""What the router chose in a step, kept only while someone looks (the routing stream,
an ask with debug_routing).

Shape letters: L MoE layers, T rows of the step (every token of every sequence in it),
A experts per token, E experts per layer.

Each MoE block hands the capture the arrays its libcolibri routing call already filled (the
(T, A) expert ids and mixing weights); the capture keeps references, no copies, and turns
them into per-layer counts with one bincount for the whole step. Disabled, it costs one
attribute test per MoE layer step: the engine thread enables it before a step only when a
subscriber or a debug_routing ask exists.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepRouting:
    """The routing of one step: every MoE layer's choice for every row."""

    layers: list[int]  # (L,) the MoE layers' indices, in order
    experts: np.ndarray  # (L, T, A) int, chosen experts per layer and row, best first
    weights: np.ndarray  # (L, T, A) float32, their mixing weights
    bounds: np.ndarray  # (N + 1,) int64: sequence i of the step has rows bounds[i] .. bounds[i + 1]
    num_experts: int  # E

    @property
    def rows(self) -> int:
        return int(self.experts.shape[1])

    def counts(self) -> np.ndarray:
        """(L, E) int64: how many rows of the step chose each expert, per layer (one bincount)."""
        n_layers = len(self.layers)
        offsets = (np.arange(n_layers, dtype=np.int64) * self.num_experts)[:, None, None]  # (L, 1, 1)
        flat = (self.experts.astype(np.int64) + offsets).ravel()
        return np.bincount(flat, minlength=n_layers * self.num_experts).reshape(n_layers, self.num_experts)

    def row(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """One row's choice in every layer: experts (L, A) and weights (L, A)."""
        return self.experts[:, index, :], self.weights[:, index, :]

    def last_row_of(self, sequence: int) -> int | None:
        """The row whose logits a sequence of the step samples from (its last), None if it had no rows."""
        start, end = int(self.bounds[sequence]), int(self.bounds[sequence + 1])
        return end - 1 if end > start else None


class RoutingCapture:
    """The model's recorder of routing choices. The engine thread sets ``enabled`` between
    steps; MoE blocks call record() during a step only while it is set."""

    def __init__(self, moe_layers: list[int], num_experts: int) -> None:
        self.enabled = False
        self.moe_layers = list(moe_layers)
        self.num_experts = num_experts
        self._bounds = np.zeros(2, np.int64)
        self._experts: dict[int, np.ndarray] = {}  # layer -> (T, A)
        self._weights: dict[int, np.ndarray] = {}  # layer -> (T, A)

    def begin_step(self, bounds: np.ndarray) -> None:
        """A step of these row bounds begins: forget the previous one."""
        self._bounds = bounds
        self._experts.clear()
        self._weights.clear()

    def record(self, layer: int, experts: np.ndarray, weights: np.ndarray) -> None:
        """A MoE layer's routing of every row of the step (references: the arrays are fresh per call)."""
        self._experts[layer] = experts
        self._weights[layer] = weights

    def step(self) -> StepRouting | None:
        """The step just run, if it was recorded whole (every MoE layer), else None."""
        if not self.moe_layers or any(layer not in self._experts for layer in self.moe_layers):
            return None
        experts = np.stack([self._experts[layer] for layer in self.moe_layers])  # (L, T, A)
        weights = np.stack([self._weights[layer] for layer in self.moe_layers]).astype(np.float32, copy=False)
        return StepRouting(self.moe_layers, experts, weights, self._bounds, self.num_experts)
