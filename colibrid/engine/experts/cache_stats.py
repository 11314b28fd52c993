"""The expert cache's counters, as status and the benches read them: per layer and in total,
hits, misses, bytes read, evictions, read latency percentiles (ms), and how well prefetch
guessed (precision: predicted experts that were then requested; recall: requested experts
that had been predicted).

The C cache counts reads and hits; the prediction counts are kept here, because only the
Python side sees both what prefetch() named and what the next acquire() asked for.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from colibrid import native


@dataclass
class LayerPredictions:
    """Prefetch prediction quality of one layer: predicted vs. actually requested experts."""

    predicted: int = 0  # experts named by prefetch()
    requested: int = 0  # experts requested by acquire() after a prediction
    correct: int = 0  # requested experts that were predicted
    last: set = field(default_factory=set)  # the experts the last prefetch() named


class PredictionTally:
    """LayerPredictions for each of ``n_layers`` layers."""

    def __init__(self, n_layers: int) -> None:
        self.layers = [LayerPredictions() for _ in range(n_layers)]

    def note_predicted(self, layer: int, ids: list[int]) -> None:
        pred = self.layers[layer]
        pred.last = set(ids)
        pred.predicted += len(ids)

    def note_requested(self, layer: int, ids: list[int]) -> None:
        pred = self.layers[layer]
        if pred.last:
            pred.requested += len(ids)
            pred.correct += len(pred.last.intersection(ids))

    def totals(self) -> tuple[int, int, int]:
        """(predicted, requested, correct) over every layer."""
        return (sum(p.predicted for p in self.layers), sum(p.requested for p in self.layers),
                sum(p.correct for p in self.layers))

    def reset(self) -> None:
        self.layers = [LayerPredictions() for _ in self.layers]


def percentile_ms(hist: np.ndarray, q: float) -> float | None:
    """Upper edge (ms) of the histogram bucket holding the q-quantile; None if empty.
    ``hist``: (native.LATENCY_BUCKETS,) read counts per latency bucket."""
    total = int(hist.sum())
    if total == 0:
        return None
    rank = q * total
    b = int(np.searchsorted(np.cumsum(hist), rank, side="left"))
    b = min(b, len(hist) - 1)
    upper_us = native.latency_bucket_lower_us(b + 1) if b + 1 < len(hist) else native.latency_bucket_lower_us(b) * 2
    return round(max(upper_us, 1.0) / 1000.0, 3)


def derived_stats(st: dict, hist: np.ndarray, predicted: int, requested: int, correct: int) -> dict:
    """Rates and percentiles from the raw counters ``st`` and latency histogram ``hist``."""
    requests = st.get("hits", 0) + st.get("inflight_hits", 0) + st.get("misses", 0)
    return {
        "requests": requests,
        "hit_rate": (st.get("hits", 0) + st.get("inflight_hits", 0)) / requests if requests else None,
        "read_ms_p50": percentile_ms(hist, 0.50),
        "read_ms_p90": percentile_ms(hist, 0.90),
        "read_ms_p99": percentile_ms(hist, 0.99),
        "prediction_precision": correct / predicted if predicted else None,
        "prediction_recall": correct / requested if requested else None,
    }


def cache_stats(core: native.ExpertCacheCore, loader: native.Loader, moe_layers: Iterable[int],
                predictions: PredictionTally) -> dict:
    """Per-layer and total counters of ``core`` over ``moe_layers`` (the layers with expert
    records), with the prediction counts and ``loader``'s own counters."""
    layers = []
    total: dict = {}
    hist_total = np.zeros(native.LATENCY_BUCKETS, dtype=np.int64)
    for layer in moe_layers:
        st = core.layer_stats(layer)
        hist = np.asarray(st.pop("latency_us"), dtype=np.int64)  # (LATENCY_BUCKETS,)
        hist_total += hist
        pred = predictions.layers[layer]
        st.update(layer=layer, **derived_stats(st, hist, pred.predicted, pred.requested, pred.correct))
        layers.append(st)
        for k, v in st.items():
            if isinstance(v, int) and k != "layer":
                total[k] = total.get(k, 0) + v
    total.update(derived_stats(total, hist_total, *predictions.totals()))
    loader_info = loader.info()
    resident, pinned = core.count()
    return {"layers": layers, "total": total, "resident": resident, "pinned": pinned,
            "loader": {k: loader_info[k] for k in ("reads", "bytes_read", "failures", "busy_ns", "queue_depth")}}
