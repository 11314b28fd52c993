"""The Mixture-of-Experts block, written once for every architecture:
router -> softmax -> top-k -> optional renormalisation, then each selected expert
runs once over all the tokens routed to it (batch-union), plus an optional shared
expert with an optional sigmoid gate."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibrid import native
from colibrid.engine.experts import ExpertSource
from colibrid.engine.layers import linear, softmax, swiglu_mlp
from colibrid.models.config import ModelConfig
from colibrid.pack.tensor import PackedTensor


@dataclass(frozen=True)
class Routing:
    experts: np.ndarray  # (T, A) int, chosen experts, best first
    weights: np.ndarray  # (T, A) float32, their mixing weights


def route(x: np.ndarray, router: PackedTensor, top_k: int, normalize: bool) -> Routing:
    """Softmax over all experts, keep the top ``top_k``, optionally renormalise."""
    probs = softmax(linear(x, router), axis=-1)  # (T, E)
    # Stable sort of the negated probabilities: descending, lower index first on ties.
    chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]  # (T, A)
    weights = np.take_along_axis(probs, chosen, axis=-1)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return Routing(chosen, weights.astype(np.float32))


class MoeBlock:
    def __init__(self, config: ModelConfig, layer: int, weights: dict[str, PackedTensor], experts: ExpertSource) -> None:
        self.c = config
        self.layer = layer
        self.w = weights  # pack names without the "layers.{l}." prefix
        self.experts = experts

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        routing = route(x, self.w["router"], self.c.num_experts_per_tok, self.c.norm_topk_prob)
        out = np.zeros_like(x)  # (T, D)
        selected = [int(e) for e in np.unique(routing.experts)]  # batch-union: each expert once per step
        # A long prompt may touch more experts than the cache can pin at once: run them in waves.
        wave_size = max(1, getattr(self.experts, "max_pinned", len(selected)))
        for start in range(0, len(selected), wave_size):
            wave = selected[start : start + wave_size]
            with self.experts.acquire(self.layer, wave) as weights:
                self._run_wave(x, routing, wave, [weights[e] for e in wave], out)
        if self.c.shared_expert_ffn:
            shared = swiglu_mlp(x, self.w["shared.gate"], self.w["shared.up"], self.w["shared.down"])
            if self.c.shared_expert_gated:
                gate = linear(x, self.w["shared_gate"])  # (T, 1)
                with np.errstate(over="ignore"):  # sigmoid(gate); exp overflow -> weight 0
                    shared = shared / (np.float32(1.0) + np.exp(-gate))
            out += shared
        return out


    def _run_wave(self, x: np.ndarray, routing: Routing, wave: list[int], weights: list, out: np.ndarray) -> None:
        """Adds the experts of ``wave`` (increasing ids) to ``out``: one libcolibri call."""
        types = {part.type for ew in weights for part in (ew.gate, ew.up, ew.down)}
        if len(types) != 1:  # mixed expert types (not produced by the converter): one at a time
            for expert, ew in zip(wave, weights):
                tokens, slots = np.nonzero(routing.experts == expert)
                y = swiglu_mlp(x[tokens], ew.gate, ew.up, ew.down)  # (n, D)
                out[tokens] += y * routing.weights[tokens, slots][:, None]
            return
        index_in_wave = np.full(self.c.num_experts, -1, dtype=np.int32)
        index_in_wave[wave] = np.arange(len(wave), dtype=np.int32)
        ffn, dim = weights[0].gate.shape
        native.moe_experts(types.pop(), [ew.gate.data for ew in weights], [ew.up.data for ew in weights],
                           [ew.down.data for ew in weights], dim, ffn, x, index_in_wave[routing.experts],
                           routing.weights, out)


class DenseMlp:
    """A layer without routed experts (mlp_only_layers, decoder_sparse_step)."""

    def __init__(self, weights: dict[str, PackedTensor]) -> None:
        self.w = weights

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return swiglu_mlp(x, self.w["mlp.gate"], self.w["mlp.up"], self.w["mlp.down"])
