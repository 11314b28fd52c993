"""What the router chose in a step, kept only while someone looks (the routing stream,
an ask with debug_routing).

Shape letters: L MoE layers, T rows of the step (every token of every sequence in it),
A experts per token, E experts per layer.

Each MoE block hands the capture the arrays its libcolibri routing call already filled (the
(T, A) expert ids and mixing weights); the capture keeps references, no copies, and turns
them into per-layer counts with one bincount for the whole step. Disabled, it costs one
attribute test per MoE layer step: the engine thread enables it before a step only when a
subscriber or a debug_routing ask exists.

With ``keep_hidden`` also set (bench/predictor_study.py, never the daemon), it keeps copies of
each MoE layer's input rows and of the residual stream after the layer, what a lookahead
predictor could read; off, that costs one more attribute test per layer step while enabled.
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
    moe_inputs: np.ndarray | None = None  # (L, T, D) float32 each MoE layer's input rows, kept with keep_hidden
    residuals: np.ndarray | None = None  # (L, T, D) float32 the residual stream after each MoE layer, likewise

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
        self.keep_hidden = False  # while enabled, also keep hidden states (record_hidden)
        self.moe_layers = list(moe_layers)
        self.num_experts = num_experts
        self._bounds = np.zeros(2, np.int64)
        self._experts: dict[int, np.ndarray] = {}  # layer -> (T, A)
        self._weights: dict[int, np.ndarray] = {}  # layer -> (T, A)
        self._hidden: dict[tuple[str, int], np.ndarray] = {}  # ("moe_input" | "residual", layer) -> (T, D)

    def begin_step(self, bounds: np.ndarray) -> None:
        """A step of these row bounds begins: forget the previous one."""
        self._bounds = bounds
        self._experts.clear()
        self._weights.clear()
        self._hidden.clear()

    def record(self, layer: int, experts: np.ndarray, weights: np.ndarray) -> None:
        """A MoE layer's routing of every row of the step (references: the arrays are fresh per call)."""
        self._experts[layer] = experts
        self._weights[layer] = weights

    def record_hidden(self, kind: str, layer: int, rows: np.ndarray) -> None:
        """A copy of a MoE layer's ``kind`` rows (T, D): "moe_input" (what its experts and
        router read) or "residual" (the residual stream after the layer). Copied: the engine
        updates the residual stream in place."""
        if kind not in ("moe_input", "residual"):
            raise ValueError(f"unknown hidden state {kind!r}")
        self._hidden[kind, layer] = np.array(rows, dtype=np.float32)

    def _stacked_hidden(self, kind: str) -> np.ndarray | None:
        if any((kind, layer) not in self._hidden for layer in self.moe_layers):
            return None
        return np.stack([self._hidden[kind, layer] for layer in self.moe_layers])  # (L, T, D)

    def step(self) -> StepRouting | None:
        """The step just run, if it was recorded whole (every MoE layer), else None."""
        if not self.moe_layers or any(layer not in self._experts for layer in self.moe_layers):
            return None
        experts = np.stack([self._experts[layer] for layer in self.moe_layers])  # (L, T, A)
        weights = np.stack([self._weights[layer] for layer in self.moe_layers]).astype(np.float32, copy=False)
        return StepRouting(self.moe_layers, experts, weights, self._bounds, self.num_experts,
                           self._stacked_hidden("moe_input"), self._stacked_hidden("residual"))
