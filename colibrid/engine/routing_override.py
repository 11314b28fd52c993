"""Routing decisions replayed from a recorded trace instead of the router's: for benchmarks
only (bench/bench_aepc.py run --routing-trace). No config key, request field or daemon code
path creates one; a bench builds it and installs it on a Model itself.

Why: the OLMoE-shaped bench packs have random weights, so their router spreads every token
uniformly over the experts, with none of the locality real routing has. Replaying a trained
model's recorded choices on such a pack measures the expert cache and the lookahead under
real routing at the bench pack's real sizes.

What it replaces, per MoE layer step:
- the chosen experts of every row (best first), taken from the trace; the mixing weights stay
  the router's own by rank (the row's best forced expert gets the router's largest weight, and
  so on), so they sum as the router's do and the compute is that of the model's routing;
- the lookahead's guesses of the next MoE layer's experts (best first), taken from the trace
  too when it recorded them: the random router's own guesses would say nothing about the
  replayed choices.

An oracle replay (``oracle_guesses``) hands the lookahead the next layer's true experts as its
guesses (the bench then has the lookahead read all top-k of them ahead): a predictor that is
never wrong and misses nothing, so what it gains over reading on demand bounds what any
next-layer predictor can gain.

Layer mapping: the pack's i-th MoE layer takes the trace's layer i mod L (L the trace's MoE
layers), so an 8-layer trace drives a 16-layer pack twice over. Guesses made at trace layer
l are for trace layer l+1; at the wrap (pack layer i with i mod L = L-1, whose next layer takes
trace layer 0) the trace has none and the lookahead prefetches nothing.

Shape letters: L the trace's MoE layers, T rows of the step, A experts per token, G guesses
per row. Installed or not, the engine's only cost is one attribute test per MoE layer step.
"""

from __future__ import annotations

import numpy as np


class RoutingOverride:
    """Forced routing for the steps a bench runs: set_step() before each step, with the
    trace's choices for that step's rows."""

    def __init__(self, moe_layers: list[int], num_experts: int, top_k: int, trace_layers: int) -> None:
        if trace_layers < 1:
            raise ValueError("a routing trace needs at least one MoE layer")
        self.num_experts = num_experts
        self.top_k = top_k
        self.trace_layers = trace_layers
        # pack MoE layer id -> its position i among the MoE layers (trace layer i mod L)
        self._position = {layer: i for i, layer in enumerate(moe_layers)}
        self._experts: np.ndarray | None = None  # (L, T, A) int32 the step's forced experts
        self._guesses: np.ndarray | None = None  # (L - 1, T, G) int32 guesses of trace layer l+1 made at l

    @classmethod
    def for_model(cls, model, trace_layers: int) -> "RoutingOverride":
        c = model.config
        return cls(model.routing_capture.moe_layers, c.num_experts, c.num_experts_per_tok, trace_layers)

    def install(self, model) -> None:
        """Every MoE block of ``model`` routes through this override from its next step on."""
        for layer in model.layers:
            if layer.moe is not None:
                layer.moe.override = self

    @staticmethod
    def uninstall(model) -> None:
        for layer in model.layers:
            if layer.moe is not None:
                layer.moe.override = None

    @staticmethod
    def oracle_guesses(experts: np.ndarray) -> np.ndarray:
        """(L - 1, T, A) guesses of trace layer l+1 made at l that are its true experts
        ``experts`` (L, T, A): what a perfect next-layer predictor would guess."""
        return np.asarray(experts)[1:]

    def trace_layer_of(self, layer: int) -> int:
        """The trace layer the pack's MoE layer ``layer`` replays."""
        return self._position[layer] % self.trace_layers

    def set_step(self, experts: np.ndarray, guesses: np.ndarray | None = None) -> None:
        """The next step's routing: ``experts`` (L, T, A) distinct per row, best first;
        ``guesses`` (L - 1, T, G) best first, or None (no lookahead guesses)."""
        experts = np.asarray(experts)
        if experts.ndim != 3 or experts.shape[0] != self.trace_layers or experts.shape[2] != self.top_k:
            raise ValueError(f"forced experts must be (L={self.trace_layers}, rows, top-k={self.top_k}), "
                             f"got {experts.shape}")
        self._check_ids(experts, "forced experts")
        ordered = np.sort(experts, axis=2)
        if (ordered[:, :, 1:] == ordered[:, :, :-1]).any():
            raise ValueError("forced experts must be distinct within a row")
        if guesses is not None:
            guesses = np.asarray(guesses)
            if guesses.ndim != 3 or guesses.shape[:2] != (self.trace_layers - 1, experts.shape[1]):
                raise ValueError(f"guesses must be (L-1={self.trace_layers - 1}, rows={experts.shape[1]}, G), "
                                 f"got {guesses.shape}")
            self._check_ids(guesses, "guesses")
            guesses = guesses.astype(np.int32)
        self._experts, self._guesses = experts.astype(np.int32), guesses

    def _check_ids(self, ids: np.ndarray, what: str) -> None:
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_experts):
            raise ValueError(f"{what} must be expert ids in [0, {self.num_experts})")

    def experts_for(self, layer: int, rows: int) -> np.ndarray:
        """(T, A) the experts the pack's MoE layer ``layer`` must use for the step's ``rows`` rows."""
        if self._experts is None:
            raise RuntimeError("a routing override is installed but no step was set")
        if self._experts.shape[1] != rows:
            raise ValueError(f"the replayed step has {self._experts.shape[1]} rows, the engine's {rows}")
        return self._experts[self.trace_layer_of(layer)]

    def guesses_after(self, layer: int, rows: int) -> np.ndarray:
        """(T, G) the recorded guesses of the next MoE layer's experts, best first, made at the
        pack's MoE layer ``layer``; (T, 0) where the trace has none (no guesses recorded, or
        the wrap from the trace's last layer to its first)."""
        trace_layer = self.trace_layer_of(layer)
        if self._guesses is None or trace_layer == self.trace_layers - 1 or self._guesses.shape[1] != rows:
            return np.empty((rows, 0), np.int32)
        return self._guesses[trace_layer]
