"""The `routing` stream (docs/protocol.md): what the router chose, step by step, for the
clients that subscribed (`colibrictl top`, bench_aepc's trace recorder), and each token's
own choice for an ask with debug_routing.

Two threads meet here. The engine thread, between steps, turns the model's RoutingCapture
on only while a subscriber or a debug_routing ask exists (before_step), and after a step
turns what was captured into one summary: per MoE layer, the experts chosen and how many
rows chose each, and the expert cache's hits and misses in the step (after_step). It hands
summaries to the event loop through a short queue and never waits for it. The loop fans
each summary out to the subscribers' connections.

Nothing here can grow with a slow subscriber: the hand-over queue holds at most
PENDING_SUMMARIES (the oldest are dropped), and a subscriber whose connection already holds
more than its backlog of unread replies gets no more summaries until it reads; each
summary it misses is counted and the next one it gets says how many (`dropped`). At most
MAX_SUBSCRIBERS subscriptions exist at once; one more is refused with `busy`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from colibrid.engine.routing_capture import RoutingCapture, StepRouting
from colibrid.wire.errors import RequestId
from colibrid.wire.events import RoutingEvent, RoutingLayer

log = logging.getLogger(__name__)

MAX_SUBSCRIBERS = 8
# Summaries made by the engine thread that the event loop has not yet handed out; beyond it
# the oldest are dropped (and counted for every subscriber).
PENDING_SUMMARIES = 64
# The most unread replies (bytes of encoded frames) a subscriber's connection may hold before
# summaries are dropped for it instead of queued; at most half its max_outbox_bytes, so a
# subscriber that does not read is never closed as a slow client because of the stream.
SUBSCRIBER_BACKLOG_BYTES = 256 * 1024


class TooManySubscribers(Exception):
    pass


@dataclass(eq=False)
class Subscription:
    """One client's subscription: where its summaries go and how many it missed."""

    request_id: RequestId
    send: Callable[[RoutingEvent], None]  # queues one event on the connection (loop thread)
    backlog_bytes: Callable[[], int]  # the connection's unread replies now
    max_backlog_bytes: int
    dropped: int = 0  # summaries missed since the last one it was sent
    sent: int = 0


class RoutingStream:
    def __init__(self, capture: RoutingCapture, layer_counters: Callable[[], dict[int, tuple[int, int]] | None],
                 max_subscribers: int = MAX_SUBSCRIBERS, max_pending: int = PENDING_SUMMARIES) -> None:
        self.capture = capture
        self._layer_counters = layer_counters  # the expert source's per-layer (hits, misses) so far
        self.max_subscribers = max_subscribers
        # Replaced, never changed in place: the engine thread reads it without the lock.
        self._subscribers: tuple[Subscription, ...] = ()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()  # guards the hand-over below
        # Summaries as events of no request yet: each subscriber gets a copy with its id and dropped count.
        self._pending: collections.deque[RoutingEvent] = collections.deque()
        self._max_pending = max_pending
        self._overflowed = 0  # summaries dropped from the hand-over since the loop last took it
        self._delivery_scheduled = False
        # The engine thread's view of the step being run
        self._counters_before: dict[int, tuple[int, int]] | None = None
        self._step_started_s = 0.0
        self.summaries_made = 0

    # -- the event loop's side ----------------------------------------------------------

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    def subscribe(self, request_id: RequestId, send: Callable[[RoutingEvent], None],
                  backlog_bytes: Callable[[], int], max_outbox_bytes: int) -> Subscription:
        """A new subscription (on the loop thread); TooManySubscribers past max_subscribers."""
        if len(self._subscribers) >= self.max_subscribers:
            raise TooManySubscribers(f"colibrid serves at most {self.max_subscribers} routing subscriptions at once")
        self._loop = asyncio.get_running_loop()
        subscription = Subscription(request_id, send, backlog_bytes,
                                    max(1, min(SUBSCRIBER_BACKLOG_BYTES, max_outbox_bytes // 2)))
        self._subscribers = self._subscribers + (subscription,)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        self._subscribers = tuple(s for s in self._subscribers if s is not subscription)

    def _deliver(self) -> None:
        """On the loop: hand every pending summary to every subscriber that has room for it."""
        with self._lock:
            summaries = list(self._pending)
            self._pending.clear()
            overflowed, self._overflowed = self._overflowed, 0
            self._delivery_scheduled = False
        for subscription in self._subscribers:
            subscription.dropped += overflowed
            for summary in summaries:
                if subscription.backlog_bytes() > subscription.max_backlog_bytes:
                    subscription.dropped += 1  # it has not read what it has: never queue more
                    continue
                subscription.send(replace(summary, id=subscription.request_id, dropped=subscription.dropped))
                subscription.dropped = 0
                subscription.sent += 1

    # -- the engine thread's side -------------------------------------------------------

    def before_step(self, debug_asks: bool) -> None:
        """Between steps: capture the coming step if a subscriber or a debug_routing ask wants it."""
        streaming = bool(self._subscribers)
        self.capture.enabled = streaming or debug_asks
        self._counters_before = self._layer_counters() if streaming else None
        self._step_started_s = time.monotonic()

    def after_step(self, step: int) -> StepRouting | None:
        """After a step that ran: its routing if it was captured, with its summary published to
        the subscribers (when there are any)."""
        if not self.capture.enabled:
            return None
        routing = self.capture.step()
        if routing is None or not self._subscribers or self._loop is None:
            return routing
        step_ms = (time.monotonic() - self._step_started_s) * 1000.0
        self._publish(self._summary(routing, step, step_ms))
        return routing

    def _summary(self, routing: StepRouting, step: int, step_ms: float) -> RoutingEvent:
        counts = routing.counts()  # (L, E)
        before, after = self._counters_before, self._layer_counters() if self._counters_before is not None else None
        layers = []
        for index, layer in enumerate(routing.layers):
            chosen = np.flatnonzero(counts[index])  # the experts the layer ran, increasing
            hits = misses = None
            if before is not None and after is not None and layer in after:
                hits = after[layer][0] - before.get(layer, (0, 0))[0]
                misses = after[layer][1] - before.get(layer, (0, 0))[1]
            layers.append(RoutingLayer(layer, chosen.tolist(), counts[index, chosen].tolist(), hits, misses))
        return RoutingEvent(None, step, step_ms, routing.rows, int(routing.bounds.shape[0] - 1), layers)

    def _publish(self, summary: RoutingEvent) -> None:
        with self._lock:
            if len(self._pending) >= self._max_pending:
                self._pending.popleft()
                self._overflowed += 1
            self._pending.append(summary)
            self.summaries_made += 1
            if self._delivery_scheduled:
                return
            self._delivery_scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed: the daemon is stopping, nobody to tell
            pass


def token_rows(routing: StepRouting, sequence: int) -> tuple[list[list[int]], list[list[float]]] | None:
    """The experts (L, A) and weights (L, A) of the row a step's ``sequence`` sampled its token
    from, as lists; None if it had no rows."""
    row = routing.last_row_of(sequence)
    if row is None:
        return None
    experts, weights = routing.row(row)
    return experts.tolist(), np.round(weights.astype(np.float64), 6).tolist()
