"""The router's health over a window of recent tokens, from the daemon's `routing` stream.

Per MoE layer, over the last ``window_tokens`` routed tokens (whole steps, so at least that
many):

- **load**: how many tokens chose each expert (a token chooses top_k distinct experts);
- **entropy**: Shannon entropy of the load, divided by log(num_experts): 1.0 when every
  expert is chosen equally often, falling towards log(top_k)/log(num_experts) as the tokens
  pile onto the same top_k experts;
- **imbalance**: max/mean expert load (the mean over all num_experts experts, unchosen ones
  included): 1.0 is perfect balance, num_experts/top_k is the most possible (one expert chosen
  by every token);
- **top share**: the fraction of the window's tokens that chose the busiest expert.

A layer's routing has **collapsed** when, over at least MIN_COLLAPSE_TOKENS tokens, its busiest
expert's top share is above the collapse share: by default halfway between its fair share
(top_k/num_experts, what each expert gets when routing is uniform) and 1.0 (every token):
(1 + top_k/num_experts) / 2. With 64 experts and top-8 that is 56 % of the tokens; with 16
and top-4, 62.5 %. A share of routed *slots* would not do: a token takes top_k slots in
top_k different experts, so no expert can hold more than 1/top_k of them.

Standard library (and the protocol's events) only: the client runs where the daemon's
dependencies are not installed.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Any, Iterable

from colibrid.wire.events import RoutingEvent, SubscribedEvent

MIN_COLLAPSE_TOKENS = 32  # fewer tokens than this say too little about a router


def entropy(counts: Iterable[int], num_experts: int) -> float | None:
    """Normalised Shannon entropy of an expert load (None for no load or a single expert)."""
    counts = [c for c in counts if c > 0]
    total = sum(counts)
    if total == 0 or num_experts < 2:
        return None
    h = -sum((c / total) * math.log(c / total) for c in counts)
    return h / math.log(num_experts)


def imbalance(counts: Iterable[int], num_experts: int) -> float | None:
    """Max/mean expert load over num_experts experts (None for no load)."""
    counts = list(counts)
    total = sum(counts)
    if total == 0 or num_experts < 1:
        return None
    return max(counts) / (total / num_experts)


def default_collapse_share(num_experts: int, top_k: int) -> float:
    """Halfway between the fair share (top_k/num_experts) and every token."""
    fair = min(1.0, top_k / num_experts) if num_experts else 1.0
    return (1.0 + fair) / 2.0


@dataclass(frozen=True)
class LayerHealth:
    layer: int
    tokens: int  # tokens routed in the window
    counts: list[int]  # (E,) tokens that chose each expert
    hits: int | None  # expert cache hits and misses in the window's steps (None: no cache)
    misses: int | None
    entropy: float | None
    imbalance: float | None
    top_expert: int | None
    top_share: float | None  # of the window's tokens, the fraction that chose top_expert
    collapsed: bool

    def as_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class RoutingWindow:
    """The last routing summaries covering at least ``window_tokens`` tokens, per layer."""

    def __init__(self, moe_layers: list[int], num_experts: int, top_k: int, window_tokens: int = 256,
                 collapse_share: float | None = None) -> None:
        if window_tokens < 1:
            raise ValueError("the window must hold at least one token")
        self.moe_layers = list(moe_layers)
        self.num_experts = num_experts
        self.top_k = top_k
        self.window_tokens = window_tokens
        self.collapse_share = default_collapse_share(num_experts, top_k) if collapse_share is None else collapse_share
        self._steps: collections.deque[RoutingEvent] = collections.deque()  # summaries, oldest first
        self._tokens = 0
        self.dropped = 0  # summaries the daemon dropped for us since we subscribed
        self.steps_seen = 0

    @classmethod
    def from_subscribed(cls, event: SubscribedEvent, window_tokens: int = 256,
                        collapse_share: float | None = None) -> "RoutingWindow":
        """From a `subscribed` event's routing shape."""
        return cls(event.moe_layers, event.num_experts, event.experts_per_token, window_tokens, collapse_share)

    @property
    def tokens(self) -> int:
        return self._tokens

    @property
    def steps(self) -> int:
        return len(self._steps)

    def add(self, event: RoutingEvent) -> None:
        """One `routing` event; steps older than the window leave it."""
        self.dropped += event.dropped
        self.steps_seen += 1
        self._steps.append(event)
        self._tokens += event.rows
        while len(self._steps) > 1 and self._tokens - self._steps[0].rows >= self.window_tokens:
            self._tokens -= self._steps.popleft().rows

    def layers(self) -> list[LayerHealth]:
        E = self.num_experts
        counts = {layer: [0] * E for layer in self.moe_layers}
        hits: dict[int, int | None] = {layer: 0 for layer in self.moe_layers}
        misses: dict[int, int | None] = {layer: 0 for layer in self.moe_layers}
        for step in self._steps:
            for entry in step.layers:
                layer = entry.layer
                if layer not in counts:
                    continue
                row = counts[layer]
                for expert, count in zip(entry.experts, entry.counts):
                    if 0 <= expert < E:  # a daemon's expert ids are not trusted to fit
                        row[expert] += count
                for value, total in ((entry.hits, hits), (entry.misses, misses)):
                    total[layer] = None if value is None or total[layer] is None else total[layer] + value
        return [self._health(layer, counts[layer], hits[layer], misses[layer]) for layer in self.moe_layers]

    def _health(self, layer: int, counts: list[int], hits: int | None, misses: int | None) -> LayerHealth:
        tokens = self._tokens
        top_expert = max(range(len(counts)), key=counts.__getitem__) if counts and any(counts) else None
        top_share = counts[top_expert] / tokens if top_expert is not None and tokens else None
        collapsed = (top_share is not None and tokens >= MIN_COLLAPSE_TOKENS and top_share > self.collapse_share)
        return LayerHealth(layer, tokens, counts, hits, misses, entropy(counts, self.num_experts),
                           imbalance(counts, self.num_experts), top_expert, top_share, collapsed)

    def warnings(self, layers: list[LayerHealth] | None = None) -> list[str]:
        """One line per collapsed layer."""
        return [f"layer {h.layer}: routing collapsed: expert {h.top_expert} chosen by {h.top_share:.0%} of the last "
                f"{h.tokens} tokens (collapse above {self.collapse_share:.0%}; fair share "
                f"{self.top_k / max(self.num_experts, 1):.0%})"
                for h in (self.layers() if layers is None else layers) if h.collapsed]
