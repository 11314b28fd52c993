"""The Mixture-of-Experts block, written once for every architecture:
router (optionally with a logit bias) -> scores (softmax, or sigmoid with a choice-only bias)
-> optional group limit -> top-k (or top-k logits, then a softmax over them) -> optional
renormalisation and scaling, then each selected expert runs once over all the tokens routed
to it (batch-union), with optional biases and the config's activation, its output weighted
(or its input, Llama 4), plus an optional shared expert with an optional sigmoid gate.
Gemma 4 runs a dense MLP beside the experts (DenseAndExperts), its router reading the normed
residual stream and scaling each chosen expert's weight."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from colibrid import native
from colibrid.engine.experts.source import ExpertChecksumError, ExpertDamagedError, ExpertSource
from colibrid.engine.forward.ops import linear, rms_norm, silu, swiglu_mlp
from colibrid.engine.routing_capture import RoutingCapture
from colibrid.engine.routing_override import RoutingOverride
from colibrid.models.model_config import ModelConfig
from colibrid.pack.tensor import PackedTensor


@dataclass(frozen=True)
class Routing:
    experts: np.ndarray  # (T, A) int, chosen experts, best first
    weights: np.ndarray  # (T, A) float32, their mixing weights


class Router:
    """A MoE layer's routing as the config describes it (see col_moe_router_route): the top
    num_experts_per_tok experts of every token, best first (the lower index on ties), and
    their mixing weights; one libcolibri call for all the tokens of a step. Holds no
    per-sequence state: a batch of sequences is routed as one (T, D) input. ``top_k`` ranks
    more (or fewer) experts than the model routes to, best first, for a lookahead's guesses;
    the first num_experts_per_tok of a longer ranking are the routed ones."""

    def __init__(self, config: ModelConfig, weights: dict[str, PackedTensor], top_k: int | None = None) -> None:
        router = weights["router"]  # (E, D)
        # the optional terms, where the layer has them (colibrid/models/optional_tensors.py)
        bias = weights.get("router_choice_bias")  # (E)
        logit_bias = weights.get("router_bias")  # (E)
        expert_scale = weights.get("router_expert_scale")  # (E)
        self.input_norm = weights.get("router_norm")  # (D)
        self.eps = config.rms_norm_eps
        num_experts, dim = router.shape
        self.input_scale = np.float32(dim ** -0.5)
        self.native = native.moe_router(
            router.type, router.data, num_experts, dim, top_k or config.num_experts_per_tok, normalize=config.norm_topk_prob,
            scoring=config.router_scoring, choice_bias=None if bias is None else bias.data,
            n_groups=config.router_groups, groups_kept=config.router_groups_kept,
            group_score=config.router_group_score, scaling=config.routed_scaling_factor,
            logit_bias=None if logit_bias is None else logit_bias.data,
            expert_scale=None if expert_scale is None else expert_scale.data)

    def __call__(self, x: np.ndarray) -> Routing:
        if self.input_norm is not None:  # Gemma 4: rms_norm(x) * scale * D^-0.5, in transformers' order
            x = rms_norm(x, self.input_norm, self.eps) * self.input_scale
        return Routing(*native.moe_router_route(self.native, x))


def _distinct(experts: np.ndarray) -> list[int]:
    """The experts named in ``experts`` (T, A), once each, increasing."""
    if experts.shape[0] == 1:  # one token: its top-k are already distinct
        return sorted(experts[0].tolist())
    return np.unique(experts).tolist()


class RoutingStats:
    """How much the sequences of a step share their experts, summed over MoE layer steps:
    the distinct experts a layer step ran (each read and computed once) against the sum of
    each sequence's own distinct experts (what running the sequences one by one would run).
    Their ratio is the batch's saving in expert reads and passes over expert weights."""

    def __init__(self) -> None:
        self.layer_steps = 0
        self.distinct_experts = 0  # summed over layer steps
        self.sequence_experts = 0  # summed over layer steps and the step's sequences
        self._bounds = np.zeros(2, np.int64)  # (N + 1,) the current step's row offsets per sequence

    def begin_step(self, bounds: np.ndarray) -> None:
        """The rows of the step about to run: sequence i has rows bounds[i] .. bounds[i + 1]."""
        self._bounds = bounds

    def record(self, experts: np.ndarray, distinct: int) -> None:
        """One MoE layer step that chose ``experts`` (T, A) and ran ``distinct`` experts."""
        self.layer_steps += 1
        self.distinct_experts += distinct
        bounds = self._bounds
        if bounds.shape[0] <= 2:  # one sequence: its own experts are the step's
            self.sequence_experts += distinct
            return
        self.sequence_experts += sum(len(_distinct(experts[bounds[i]:bounds[i + 1]]))
                                     for i in range(bounds.shape[0] - 1) if bounds[i + 1] > bounds[i])

    def summary(self) -> dict:
        steps = max(self.layer_steps, 1)
        return {"layer_steps": self.layer_steps,
                "distinct_experts_per_layer_step": self.distinct_experts / steps,
                "sequence_experts_per_layer_step": self.sequence_experts / steps}


class StepDamaged(ExpertDamagedError):
    """Some sequences of a step were routed to expert records known to be damaged: their
    rows' numbers are wrong, so they must fail; ``inputs`` maps each one's index in the step
    to the damaged record it needed. ``logits`` are the step's results (Model.forward_batch's),
    right for every other input - or None when no input was spared and the step stopped."""

    def __init__(self, inputs: dict, logits: list | None, pack) -> None:
        super().__init__(next(iter(inputs.values())), pack)
        self.inputs = inputs
        self.logits = logits


class DamageWatch:
    """What a step met of the pack's damage (colibrid/pack/damage.py). A MoE block leaves the
    experts marked damaged out of its sum and tells the watch which rows needed them; the
    sequences those rows belong to fail at the end of the step (StepDamaged), and the step's
    other sequences, which never touched a damaged record, go on as if there were none."""

    def __init__(self, pack) -> None:
        self.pack = pack  # the open Pack: its errors name where its records live
        self.marks = pack.damage  # the pack's DamageMarks
        self._bounds = np.zeros(2, np.int64)  # (N + 1,) the step's row offsets per sequence
        self._inputs: dict[int, object] = {}  # damaged input -> the first record it needed

    def begin_step(self, bounds: np.ndarray) -> None:
        self._bounds, self._inputs = bounds, {}

    def record(self, layer: int, experts: np.ndarray, damaged: list[int]) -> None:
        """``experts`` (T, A) were chosen in ``layer``; ``damaged`` of them were left out."""
        for expert in damaged:
            rows = np.nonzero((experts == expert).any(axis=1))[0]
            for i in np.unique(np.searchsorted(self._bounds, rows, side="right") - 1).tolist():
                self._inputs.setdefault(i, self.marks.get(layer, expert))
        if len(self._inputs) == self._bounds.shape[0] - 1:  # nothing left worth computing
            raise StepDamaged(dict(self._inputs), None, self.pack)

    def end_step(self, logits: list) -> list:
        """The step's logits, or StepDamaged if some of its inputs met damage."""
        if self._inputs:
            raise StepDamaged(dict(self._inputs), logits, self.pack)
        return logits


# Lookahead prefetch reads, per step, only the next layer's LOOKAHEAD_TOP likeliest experts.
# Replaying the 64-expert trained model's routing (top-8) on the OLMoE-shaped bench pack at a
# 25 % cache (docs/performance-log.md, "Replaying this routing"): 4 guesses are right 94 % of the
# time, +6 % tok/s over reading on demand; 8 raise the hit rate but are right 78 % of the time
# and lose 14 %, since a wrong guess costs a whole read and evicts an expert that would have hit.
LOOKAHEAD_TOP = 4


def lookahead_picks(best: np.ndarray, top: int = LOOKAHEAD_TOP) -> list[int]:
    """The ``top`` experts a step reads ahead, from each row's guesses ``best`` (T, n) best first,
    of which only each row's first ``top`` count: one row's own, in its order; for several rows,
    those the most rows guess (ties: the better rank in some row, then the lower id).

    A step reads as many guesses ahead as one token does, however many rows it has. Under a
    memory limit a batch's own misses keep the disk busy, so a guess read early saves no disk
    time and a wrong one costs a whole read. With 8 sequences on random routing, reading ahead
    the union of every row's guesses (~25 experts a layer) read 70.1 GB where these read 58.4,
    2.25-2.61 against 2.57-3.06 tok/s (docs/performance-log.md, "Asks that arrive together, a
    batch's lookahead, and the limit's KV budget"). The experts most rows name are the ones
    the step is surest to need."""
    best = best[:, :top]
    if best.shape[0] == 1:
        return best[0].tolist()
    ids, where, votes = np.unique(best, return_inverse=True, return_counts=True)
    best_rank = np.full(ids.shape[0], best.shape[1])
    np.minimum.at(best_rank, where.ravel(), np.broadcast_to(np.arange(best.shape[1]), best.shape).ravel())
    order = np.lexsort((ids, best_rank, -votes))  # the last key sorts first
    return ids[order[:top]].tolist()


# What the lookahead guesses layer l+1's experts from (config lookahead_predictor; measured in
# docs/performance-log.md, "Lookahead predictors on real routing"): layer l+1's router on
# "router-on-moe-input", layer l's MoE input, as soon as layer l's own reads are done; or on
# "router-on-residual", the residual stream leaving layer l through layer l+1's pre-MoE norm
# (what layer l+1 would read if its attention added nothing): guesses a little better, but only
# once layer l's experts have all run, so its reads overlap layer l+1's attention only.
LOOKAHEAD_PREDICTORS = ("router-on-moe-input", "router-on-residual")


class MoeBlock:
    def __init__(self, config: ModelConfig, layer: int, weights: dict[str, PackedTensor], experts: ExpertSource) -> None:
        self.c = config
        self.layer = layer
        self.w = weights  # pack names without the "layers.{l}." prefix
        self.experts = experts
        self.router = Router(config, weights)
        self.next_block: "MoeBlock | None" = None  # the next MoE layer, for lookahead prefetch (Model sets it)
        self.lookahead_predictor = LOOKAHEAD_PREDICTORS[0]  # what the lookahead guesses from (Model sets it)
        self.lookahead_top = LOOKAHEAD_TOP  # guesses read ahead a step (benches try others)
        # The next MoE layer's router input for a residual row its attention added nothing to (Model sets it)
        self.next_router_input: Callable[[np.ndarray], np.ndarray] | None = None
        self.stats: RoutingStats | None = None  # the model's, where it keeps them (Model sets it)
        self.damage: DamageWatch | None = None  # the model's (Model sets it)
        self.capture: RoutingCapture | None = None  # the model's routing recorder (Model sets it)
        self.override: RoutingOverride | None = None  # replayed routing: benches only, never the daemon

    def __call__(self, x: np.ndarray, router_input: np.ndarray | None = None) -> np.ndarray:
        """The experts' sum for x (T, D), routed on ``router_input`` (T, D) (default: x)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        routing = self.router(x if router_input is None else router_input)
        if self.override is not None:  # a bench replays recorded choices; the weights stay the router's by rank
            routing = Routing(self.override.experts_for(self.layer, x.shape[0]), routing.weights)
        selected = _distinct(routing.experts)  # batch-union: each expert once per step
        if self.stats is not None:
            self.stats.record(routing.experts, len(selected))
        if self.capture is not None and self.capture.enabled:  # someone watches the routing
            # Once per layer step, here and not in _routed: a layer started over (a load found a
            # damaged record) keeps the router's choice, which is what the watcher is shown.
            self.capture.record(self.layer, routing.experts, routing.weights)
            if self.capture.keep_hidden:
                self.capture.record_hidden("moe_input", self.layer, x)
        out = self._routed(x, routing, selected)
        if self.c.shared_expert_ffn:
            shared = swiglu_mlp(x, self.w["shared.gate"], self.w["shared.up"], self.w["shared.down"])
            if "shared_gate" in self.w:
                gate = linear(x, self.w["shared_gate"])  # (T, 1)
                with np.errstate(over="ignore"):  # sigmoid(gate); exp overflow -> weight 0
                    shared = shared / (np.float32(1.0) + np.exp(-gate))
            out += shared
        return out

    def _routed(self, x: np.ndarray, routing: Routing, selected: list[int]) -> np.ndarray:
        """The routed experts' sum (T, D). Experts marked damaged are left out, and the rows
        that needed them reported to the damage watch; a load that finds one damaged (the
        source marks it) starts the layer's sum over without it (it holds no state)."""
        while True:
            damaged = self.damage.marks.in_layer(self.layer) if self.damage is not None else ()
            usable = [e for e in selected if e not in damaged] if damaged else selected
            try:
                out = self._run_waves(x, routing, usable)
            except ExpertChecksumError as exc:
                if self.damage is None or exc.expert in damaged or exc.expert not in self.damage.marks.in_layer(self.layer):
                    raise
                continue  # marked now: the next round leaves it out
            if len(usable) < len(selected):
                self.damage.record(self.layer, routing.experts, [e for e in selected if e in damaged])
            return out

    def _run_waves(self, x: np.ndarray, routing: Routing, selected: list[int]) -> np.ndarray:
        out = np.zeros_like(x)  # (T, D)
        # A long prompt may touch more experts than the cache can pin at once: run them in waves.
        wave_size = max(1, self.experts.max_pinned)
        lookahead = self._lookahead_enabled()
        for start in range(0, len(selected), wave_size):
            wave = selected[start : start + wave_size]
            is_last_wave = start + wave_size >= len(selected)
            prefetch = partial(self._lookahead, x, wave_size) if lookahead and is_last_wave else None
            with self.experts.acquire(self.layer, wave) as weights:
                self._run_ready_runs(x, routing, wave, weights, out, when_all_loaded=prefetch)
        return out

    def _lookahead_enabled(self) -> bool:
        return (self.next_block is not None and self.lookahead_predictor == "router-on-moe-input"
                and self._prefetch_can_read())

    def _prefetch_can_read(self) -> bool:
        """Prefetch is on and has something left to read: a cache holding every expert (fully
        cached) would take every guess as a hit, so the next layer's router is not run for them
        (1 % of a step of 8 sequences on the 4-layer OLMoE shape)."""
        return self.experts.prefetch_enabled and not self.experts.holds_every_expert

    def _lookahead(self, x: np.ndarray, wave_size: int) -> None:
        """Prefetches the next MoE layer's likeliest experts, predicted by applying its router
        to this layer's input. Called once this layer's own reads are all done (see
        _run_ready_runs): the disk would otherwise idle through the rest of this layer and the
        next one's attention, and these reads never compete with a read this layer waits for.
        Only LOOKAHEAD_TOP guesses a step (lookahead_picks): a wrong guess costs a whole read of
        disk time, and the lower-ranked guesses are wrong more often (see docs/performance-log.md)."""
        self._prefetch_guesses(self._guesses(x.shape[0], lambda: x), wave_size)

    def lookahead_from_residual(self, residual: np.ndarray) -> None:
        """With lookahead_predictor "router-on-residual": prefetches the next MoE layer's
        likeliest experts, predicted by its router on the residual stream (T, D) as it leaves
        this layer, normed as that layer will norm it (Layer.feed_forward calls this last)."""
        if self.next_block is None or self.next_router_input is None or not self._prefetch_can_read():
            return
        guesses = self._guesses(residual.shape[0], lambda: self.next_router_input(residual))
        self._prefetch_guesses(guesses, max(1, self.experts.max_pinned))

    def _guesses(self, rows: int, router_input: Callable[[], np.ndarray]) -> np.ndarray:
        """(T, n) the next MoE layer's experts guessed best first for the step's ``rows`` rows:
        its router on ``router_input()`` (T, D), or what a routing override recorded (a bench
        replaying a trace)."""
        if self.override is not None:
            return self.override.guesses_after(self.layer, rows)
        return self.next_block.router(router_input()).experts

    def _prefetch_guesses(self, guessed: np.ndarray, wave_size: int) -> None:
        predicted = lookahead_picks(guessed, self.lookahead_top)
        self.experts.prefetch(self.next_block.layer, predicted[: max(1, wave_size // 2)])  # room for its own

    def _run_ready_runs(self, x: np.ndarray, routing: Routing, wave: list[int], weights, out: np.ndarray,
                        when_all_loaded: Callable[[], None] | None = None) -> None:
        """Runs ``wave`` in increasing expert order (so sums are the same for every cache size),
        each call taking the longest run of experts already loaded: cached experts compute
        while the reads of later ones are still in flight. ``when_all_loaded`` is called once
        every expert of the wave is loaded, before the last run computes."""
        start = 0
        while start < len(wave):
            end = start + 1  # weights[wave[start]] waits for that expert if needed
            while end < len(wave) and weights.is_ready(wave[end]):
                end += 1
            run = wave[start:end]
            ready = [weights[e] for e in run]
            if end == len(wave) and when_all_loaded is not None:
                when_all_loaded()
                when_all_loaded = None
            self._run_wave(x, routing, run, ready, out)
            start = end

    def _run_wave(self, x: np.ndarray, routing: Routing, wave: list[int], weights: list, out: np.ndarray) -> None:
        """Adds the experts of ``wave`` (increasing ids) to ``out``: one libcolibri call."""
        buffers = [ew.kernel_buffers for ew in weights]
        if None in buffers or len({b.type for b in buffers}) != 1:  # mixed types (not from the converter): one at a time
            for expert, ew in zip(wave, weights):
                tokens, slots = np.nonzero(routing.experts == expert)
                w = routing.weights[tokens, slots][:, None]  # (n, 1)
                if self.c.router_weight_on_input:
                    out[tokens] += _expert_ffn(self.c, x[tokens] * w, ew)
                else:
                    out[tokens] += _expert_ffn(self.c, x[tokens], ew) * w  # (n, D)
            return
        index_in_wave = np.full(self.c.num_experts, -1, dtype=np.int32)
        index_in_wave[wave] = np.arange(len(wave), dtype=np.int32)
        native.moe_experts_of(buffers, x, index_in_wave[routing.experts], routing.weights, out,
                              activation=self.c.expert_activation, alpha=self.c.swiglu_alpha, limit=self.c.swiglu_limit,
                              weight_on_input=self.c.router_weight_on_input)


def _expert_ffn(c: ModelConfig, x: np.ndarray, ew) -> np.ndarray:
    """One expert over x (n, D) step by step, as col_moe_experts_ffn computes it (for experts
    whose parts differ in type, which the converter never writes)."""
    if c.expert_activation == "swiglu" and ew.gate_bias is None:
        return swiglu_mlp(x, ew.gate, ew.up, ew.down)
    g, u = linear(x, ew.gate, ew.gate_bias), linear(x, ew.up, ew.up_bias)  # (n, F)
    if c.expert_activation == "clamped_swiglu":
        g = np.minimum(g, np.float32(c.swiglu_limit))
        u = np.clip(u, -np.float32(c.swiglu_limit), np.float32(c.swiglu_limit))
        with np.errstate(over="ignore"):
            h = (u + np.float32(1.0)) * (g * (np.float32(1.0) / (np.float32(1.0) + np.exp(-(g * np.float32(c.swiglu_alpha))))))
    elif c.expert_activation == "geglu_tanh":
        h = native.gelu_tanh_mul(g, u)
    else:
        h = silu(g) * u
    return linear(h.astype(np.float32), ew.down, ew.down_bias)


class DenseMlp:
    """A layer without routed experts (mlp_only_layers, decoder_sparse_step), or Gemma 4's MLP
    beside them: SwiGLU, or GeGLU computed by libcolibri."""

    def __init__(self, weights: dict[str, PackedTensor], activation: str = "silu") -> None:
        self.w = weights
        self.activation = activation

    def __call__(self, x: np.ndarray) -> np.ndarray:
        w = self.w
        if self.activation == "silu":
            return swiglu_mlp(x, w["mlp.gate"], w["mlp.up"], w["mlp.down"])
        return linear(native.gelu_tanh_mul(linear(x, w["mlp.gate"]), linear(x, w["mlp.up"])), w["mlp.down"])


class DenseAndExperts:
    """Gemma 4's feed-forward: the dense MLP and the routed experts side by side on the layer's
    residual stream x, each behind its own input norm and after its own output norm; the
    router scores the un-normed x (Router applies its own norm). Returns their sum (T, D),
    which the layer norms again before the residual add."""

    def __init__(self, config: ModelConfig, layer: int, weights: dict[str, PackedTensor], experts: ExpertSource) -> None:
        self.eps = config.rms_norm_eps
        self.w = weights
        self.mlp = DenseMlp(weights, config.hidden_act)
        self.moe = MoeBlock(config, layer, weights, experts)

    @property
    def experts(self) -> ExpertSource:
        return self.moe.experts

    @experts.setter
    def experts(self, source: ExpertSource) -> None:
        self.moe.experts = source

    def __call__(self, x: np.ndarray) -> np.ndarray:
        w, eps = self.w, self.eps
        dense = rms_norm(self.mlp(rms_norm(x, w["ffn_norm"], eps)), w["mlp_post_norm"], eps)
        routed = self.moe(rms_norm(x, w["experts_norm"], eps), router_input=x)
        return dense + rms_norm(routed, w["experts_post_norm"], eps)
