"""The step plan: which sequences of a batch take part in the next step, and with which tokens.

This is the contract between the batch (engine/batch.py) and the model step it runs.
``plan_step`` looks at the running sequences in arrival order and returns a StepPlan, one
PlannedRows per sequence in the step, in that order:

- Every decoding sequence (one that has sampled a token) is in every step, with one token: the
  last one it sampled. A step never leaves a decoding sequence without its next token.
- Prompts are fed in chunks of at most ``prefill_chunk`` tokens, and always cut at the same
  places, every ``prefill_chunk`` tokens of their own (after any prefix resumed from the prefix
  cache), whatever else runs: DeltaNet's chunked prefill rounds differently for different
  cuts, and a request's numbers must not depend on its neighbours.
- The prompt token budget of a step is ``prefill_chunk`` while any sequence decodes: it bounds
  how long a step keeps the decoding sequences from their next token. While none decodes,
  nobody waits on the step, so the budget is IDLE_PREFILL_CHUNKS times that (whole chunks of
  different prompts): requests waiting together get their first tokens together, in one pass
  over the experts' weights instead of one per chunk, and no request's first tokens then wait
  on a second prompt step.
- Prompt chunks are taken in arrival order, first come, first fed: each next chunk that fits in
  what is left of the budget joins the step; the first that does not fit ends the prompt
  feeding for this step, so a later, shorter prompt never overtakes an earlier one. A chunk is
  never larger than the budget, so a step with a pending prompt always feeds one.

The KV budget is not the planner's: it is spent at admission (Batch.has_room), where each
sequence's state is allocated whole, so every admitted sequence can always be planned.

The plan only reads the sequences: planning takes no token, and planning twice gives the same
plan. The step that runs it takes the planned tokens (Generation.next_input).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from colibrid.engine.generate import Generation

# Prompt tokens a step takes while no sequence decodes, in prefill_chunks: twice a normal
# step's, which keeps its transient memory (activations, the experts' inputs) within twice
# what the daemon already needs for a step with a chunk and max_batch decoding rows.
IDLE_PREFILL_CHUNKS = 2


class PlannableSequence(Protocol):
    """What the planner reads of a running sequence (engine/batch.py's BatchSequence)."""

    generation: Generation


@dataclass(frozen=True, eq=False)
class PlannedRows:
    """One sequence's part of a step: the rows it adds to the step's token matrix."""

    sequence: PlannableSequence
    token_ids: np.ndarray  # (T,) int32: a prompt chunk, or the one token it last sampled; a view, not to be written
    is_prompt: bool  # prompt tokens (a chunk, maybe the last), not a decoding sequence's sampled token
    samples: bool  # these tokens end its pending input: the last one's logits are sampled, a token comes out
    ends_prompt_chunk: bool  # a whole prompt chunk of prefill_chunk tokens: where its prompt is cut

    @property
    def tokens(self) -> int:
        return self.token_ids.shape[0]


@dataclass(frozen=True, eq=False)
class StepPlan:
    """The sequences of one step, in arrival order, and the prompt token budget it was planned
    with (prefill_chunk, or IDLE_PREFILL_CHUNKS times that while no sequence decodes)."""

    rows: tuple[PlannedRows, ...]
    prompt_token_budget: int

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[PlannedRows]:
        return iter(self.rows)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens fed in this step, at most prompt_token_budget."""
        return sum(rows.tokens for rows in self.rows if rows.is_prompt)


def plan_step(sequences: Sequence[PlannableSequence], prefill_chunk: int) -> StepPlan:
    """The next step of ``sequences`` (in arrival order), by the rules of the module docstring:
    every decoding sequence's one token, and prompt chunks of at most ``prefill_chunk`` tokens
    in arrival order, as many as fit in the step's prompt token budget."""
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, not {prefill_chunk}")
    decoding = any(not sequence.generation.prefilling for sequence in sequences)
    budget = prefill_chunk * (1 if decoding else IDLE_PREFILL_CHUNKS)
    rows, budget_left = [], budget
    for sequence in sequences:
        generation = sequence.generation
        if not generation.prefilling:
            rows.append(PlannedRows(sequence, generation.peek_input(), is_prompt=False, samples=True,
                                    ends_prompt_chunk=False))
            continue
        chunk = min(prefill_chunk, generation.pending_tokens)
        if chunk <= budget_left:
            budget_left -= chunk
            rows.append(PlannedRows(sequence, generation.peek_input(chunk), is_prompt=True,
                                    samples=chunk == generation.pending_tokens, ends_prompt_chunk=chunk == prefill_chunk))
        else:
            budget_left = 0  # the next prompts wait their turn: first come, first fed
    return StepPlan(tuple(rows), budget)
