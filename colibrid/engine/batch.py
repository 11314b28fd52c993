"""Continuous batching: many generations advanced together, one model step at a time.

A step carries one decode token for every running sequence that has sampled, and chunks of
prompt from the sequences still prefilling (at most ``prefill_chunk`` prompt tokens per step
in all while any sequence decodes, twice that while none does; whole chunks in arrival
order), so a long prompt never stalls the others' tokens for more than one chunk. That rule
is the step plan's contract (engine/step_plan.py), and each step runs one plan. The model runs
each sequence's token mixer on its own state and the feed-forward half once over every row of
the step: each routed expert is acquired and computed once per layer for all the sequences
routed to it (Model.forward_batch).

A sequence's tokens do not depend on what else runs: the kernels compute each row alone and
every sequence keeps its own sampler, seed and stop strings (Generation). Each sequence's
state is allocated whole when it is admitted, for its prompt plus max_tokens (capped by the
context), and counted against the KV budget: a sequence is admitted only when it fits, so the
batch never runs out of memory halfway.

With a prefix cache (engine/prefix_cache.py), a sequence that ends normally leaves a copy of its
state there, and a sequence admitted later whose prompt begins with kept tokens gets them
copied into its fresh state and prefills only the rest. Sequences that fail, are cancelled or
leave early keep nothing: only a state every step of which completed is ever kept.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

from colibrid.engine.generate import Generation
from colibrid.engine.forward.model import Model, StepInput
from colibrid.engine.forward.moe import StepDamaged
from colibrid.engine.prefix_cache import PrefixCache
from colibrid.engine.step_plan import StepPlan, plan_step

Outcome = "GenerationEvent | GenerationDone | SequenceFailed"


@dataclass(eq=False)
class BatchSequence:
    """One admitted generation and what the batch knows of it."""

    key: Hashable  # the caller's handle for it
    generation: Generation
    session: "object"  # colibrid.engine.engine.Session: its state is what the steps advance
    kv_bytes: int  # its state's size, reserved in the KV budget while it runs
    prefix_scope: bytes = b""  # whose kept prefixes it may reuse, and who may reuse its own
    expert_hits: int = 0  # expert cache hits and misses of the steps it took part in
    expert_misses: int = 0
    started_s: float = field(default_factory=time.monotonic)

    @property
    def phase(self) -> str:
        return "prefill" if self.generation.prefilling else "decode"

    def tokens_per_s(self) -> float:
        return self.generation.decode_tokens_per_s


@dataclass(frozen=True)
class SequenceFailed:
    """The outcome of a sequence that cannot go on (its logits were not finite, or it needed
    an expert record of the pack that is damaged): it has left the batch; the others go on."""

    message: str
    code: str = "engine"  # the protocol error code its request ends with
    damage: dict | None = None  # the damaged record it needed (DamagedRecord.to_json)


class StepFailed(Exception):
    """The model failed during a step (an expert could not be loaded). Every sequence of the
    step had its state partly advanced, so they have left the batch (``sequences``); the
    sequences that were not in the step are untouched. ``__cause__`` is the model's error."""

    def __init__(self, sequences: list["BatchSequence"]) -> None:
        super().__init__(f"a step of {len(sequences)} sequences failed")
        self.sequences = sequences


class KVBudgetExceeded(ValueError):
    """The sequence cannot fit in the KV budget even alone: it will never be admitted."""


class Batch:
    """The running sequences and the step that advances them all."""

    def __init__(self, model: Model, max_batch: int, prefill_chunk: int, kv_budget_bytes: int,
                 expert_counts=None, prefix_cache_bytes: int = 0) -> None:
        if max_batch < 1 or prefill_chunk < 1 or kv_budget_bytes < 0 or prefix_cache_bytes < 0:
            raise ValueError("max_batch and prefill_chunk must be >= 1, kv_budget_bytes and prefix_cache_bytes >= 0")
        self.model = model
        self.max_batch = max_batch
        self.prefill_chunk = min(prefill_chunk, model.max_step_tokens)
        self.kv_budget_bytes = kv_budget_bytes
        self._expert_counts = expert_counts  # () -> (hits, misses) of the expert cache so far
        self.sequences: list[BatchSequence] = []  # in arrival order
        self.steps = 0
        self.last_step_size = 0  # sequences in the last step
        # Finished sequences' states for prefix reuse; its entries resume only sequences of this
        # batch, whose prompts are cut at the same prefill_chunk boundaries (see DeltaNetState).
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes > 0 else None

    @property
    def keeps_prefixes(self) -> bool:
        """Whether finished sequences are kept for reuse: sessions should then be made
        resumable (Engine.start_generation)."""
        return self.prefix_cache is not None

    # -- admission --------------------------------------------------------------------------

    @property
    def kv_used_bytes(self) -> int:
        return sum(sequence.kv_bytes for sequence in self.sequences)

    def check_fits_alone(self, kv_bytes: int) -> None:
        """KVBudgetExceeded if a sequence of ``kv_bytes`` could never run, even in an empty batch."""
        if kv_bytes > self.kv_budget_bytes:
            raise KVBudgetExceeded(
                f"the request needs {kv_bytes / 2**20:.1f} MiB of KV cache for its prompt and max_tokens, "
                f"more than the whole KV budget ({self.kv_budget_bytes / 2**20:.1f} MiB, kv_cache_size); "
                "ask for fewer tokens")

    def has_room(self, kv_bytes: int) -> bool:
        """Whether a sequence of ``kv_bytes`` can join now (a slot free and its KV fits)."""
        return len(self.sequences) < self.max_batch and self.kv_used_bytes + kv_bytes <= self.kv_budget_bytes

    def admit(self, key: Hashable, generation: Generation, session, prefix_scope: bytes = b"") -> BatchSequence:
        """Adds a sequence (``has_room`` first). With a prefix cache, it resumes from the
        longest prefix of its prompt kept in ``prefix_scope`` (the daemon's: its user), and
        its own state is kept there when it ends."""
        kv_bytes = session.state.nbytes
        if not self.has_room(kv_bytes):
            raise RuntimeError("admit() without room: call has_room() first")
        if self.prefix_cache is not None:  # looked up now, not when it was prepared: entries come and go
            generation.skip_cached(self.prefix_cache.resume(session.state, generation.prompt_ids, prefix_scope))
        sequence = BatchSequence(key, generation, session, kv_bytes, prefix_scope)
        self.sequences.append(sequence)
        return sequence

    def remove(self, key: Hashable) -> BatchSequence | None:
        """Takes the sequence out (between steps): its state and KV reservation are freed."""
        for i, sequence in enumerate(self.sequences):
            if sequence.key == key:
                return self.sequences.pop(i)
        return None

    def __len__(self) -> int:
        return len(self.sequences)

    # -- the step -----------------------------------------------------------------------------

    def step(self) -> list[tuple[BatchSequence, list[Outcome]]]:
        """Runs the next step's plan (plan_step); returns what each sequence of the plan
        produced, in the plan's order, which is also the order the step's routing capture
        numbers its sequences by (a token event, and GenerationDone at its end; nothing for a
        prompt chunk that is not the last; SequenceFailed for one that cannot go on). Finished
        and failed sequences leave the batch. StepFailed if the model fails (see there)."""
        plan = self.plan_step()
        if not plan:
            return []
        for rows in plan:  # taken now: a sequence whose step fails leaves the batch with them
            rows.sequence.generation.next_input(rows.tokens)
        before = self._expert_counts() if self._expert_counts is not None else (0, 0)
        damaged = {}  # index in the plan -> the damaged expert record that sequence needed
        try:
            logits = self.model.forward_batch([StepInput(rows.sequence.session.state, rows.token_ids,
                                                         "last" if rows.samples else None) for rows in plan])
        except StepDamaged as exc:
            if exc.logits is None:  # no sequence of the step was spared
                raise self._leave(plan) from exc
            logits, damaged = exc.logits, exc.inputs
        except Exception as exc:
            raise self._leave(plan) from exc
        for rows in plan:
            if rows.ends_prompt_chunk:  # a whole prompt chunk: where a fresh prefill is cut too
                rows.sequence.session.state.note_prefill_chunk()
        after = self._expert_counts() if self._expert_counts is not None else (0, 0)
        self.steps += 1
        self.last_step_size = len(plan)
        return [(rows.sequence, self._damaged(rows.sequence, damaged[i]) if i in damaged else
                 self._outcomes(rows.sequence, sequence_logits if rows.samples else None,
                                after[0] - before[0], after[1] - before[1]))
                for i, (rows, sequence_logits) in enumerate(zip(plan, logits))]

    def plan_step(self) -> StepPlan:
        """The plan of the next step (engine/step_plan.py): which running sequences take part,
        with which tokens. Only reads the sequences: step() runs the plan."""
        return plan_step(self.sequences, self.prefill_chunk)

    def _leave(self, plan: StepPlan) -> StepFailed:
        """The step of ``plan`` failed: its sequences leave the batch (see StepFailed)."""
        failed = [rows.sequence for rows in plan]
        self.sequences = [sequence for sequence in self.sequences if sequence not in failed]
        return StepFailed(failed)

    def _damaged(self, sequence: BatchSequence, record) -> list[Outcome]:
        """A sequence that needed a damaged expert record: its numbers are wrong, it leaves."""
        self.sequences.remove(sequence)
        return [SequenceFailed(record.describe(self.model.pack), "pack_damaged", record.to_json())]

    def _outcomes(self, sequence: BatchSequence, logits: np.ndarray | None, hits: int, misses: int) -> list[Outcome]:
        """What one sequence's part of a step produced; it leaves the batch when it ends."""
        sequence.expert_hits += hits
        sequence.expert_misses += misses
        if logits is None:
            return []
        try:
            outcomes = sequence.generation.accept(logits[-1])
        except ValueError as exc:  # non-finite logits: this sequence's numbers are broken, not the others'
            outcomes = [SequenceFailed(f"the model's output is not finite: {exc}")]
        if sequence.generation.finished or isinstance(outcomes[-1], SequenceFailed):
            self.sequences.remove(sequence)
            if sequence.generation.finished and self.prefix_cache is not None:
                self.prefix_cache.keep(sequence.generation.fed_token_ids(), sequence.session.state,
                                       sequence.prefix_scope)
        return outcomes

    # -- observability ------------------------------------------------------------------------

    def status(self) -> dict:
        routing = self.model.routing_stats.summary()
        return {
            "max_batch": self.max_batch,
            "size": len(self.sequences),
            "last_step_size": self.last_step_size,
            "steps": self.steps,
            "prefill_chunk": self.prefill_chunk,
            "distinct_experts_per_layer_step": routing["distinct_experts_per_layer_step"],
            "sequence_experts_per_layer_step": routing["sequence_experts_per_layer_step"],
        }

    def kv_status(self) -> dict:
        return {"budget_bytes": self.kv_budget_bytes, "used_bytes": self.kv_used_bytes,
                "sequences": len(self.sequences), "type": self.model.kv_cache_type}

    def prefix_cache_status(self) -> dict:
        """The prefix cache's size and counters (budget 0: prefix reuse is off)."""
        if self.prefix_cache is None:
            return PrefixCache(0).status()
        return self.prefix_cache.status()
