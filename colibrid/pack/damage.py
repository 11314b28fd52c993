"""The expert records of an open pack known to be damaged, so a request that needs one fails
at once with an error naming it, instead of reading it again (and failing again) each time.

A record is marked when a load finds its bytes do not match its CRC-32C, or when a verify
does; a verify that reads it intact again clears the mark (the damage was not on the disk:
a bad read, or the file was restored). Thread-safe: the engine thread marks and reads, the
verify thread marks and clears, the event loop reads for status. Reads take no lock: each
layer's set is replaced, never changed in place.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import asdict, dataclass

log = logging.getLogger(__name__)

_NONE: frozenset[int] = frozenset()
MAX_SHOWN = 64  # marks listed in status (all are counted)


@dataclass(frozen=True)
class DamagedRecord:
    layer: int
    expert: int
    offset: int  # bytes into the experts region (experts.bin, or the device's region)
    length: int
    found_by: str  # "load" or "verify"
    crc32c: int | None = None  # what was read, when the checksum was wrong

    def describe(self, pack) -> str:
        """The error a request needing it gets; ``pack`` is the open Pack it belongs to."""
        how = "a verify" if self.found_by == "verify" else "loading it"
        return (f"pack damaged: expert {self.expert} of layer {self.layer} at {pack.experts.where(self.offset)} "
                f"({self.length} bytes) does not match its checksum (found by {how}); "
                f"run colibri-verify {pack.path}, then re-convert or restore the pack")

    def to_json(self) -> dict:
        return {key: value for key, value in asdict(self).items() if value is not None}


class DamageMarks:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[tuple[int, int], DamagedRecord] = {}
        self._by_layer: dict[int, frozenset[int]] = {}

    def mark(self, record: DamagedRecord) -> None:
        key = (record.layer, record.expert)
        with self._lock:
            known = key in self._records
            self._records[key] = record
            self._by_layer[record.layer] = self._by_layer.get(record.layer, _NONE) | {record.expert}
        if not known:
            log.error("expert %d of layer %d (offset %d) is damaged (found by %s): requests that need it fail "
                      "until it reads intact again", record.expert, record.layer, record.offset, record.found_by)

    def clear(self, layer: int, expert: int) -> None:
        with self._lock:
            if self._records.pop((layer, expert), None) is None:
                return
            self._by_layer[layer] = self._by_layer[layer] - {expert}
        log.warning("expert %d of layer %d reads intact again: no longer marked damaged", expert, layer)

    def in_layer(self, layer: int) -> frozenset[int]:
        """The damaged experts of ``layer`` (an empty set for a whole pack: no lock, no copy)."""
        return self._by_layer.get(layer, _NONE)

    def get(self, layer: int, expert: int) -> DamagedRecord | None:
        return self._records.get((layer, expert)) if expert in self.in_layer(layer) else None

    def records(self) -> list[DamagedRecord]:
        with self._lock:
            return sorted(self._records.values(), key=lambda r: (r.layer, r.expert))

    def __len__(self) -> int:
        return len(self._records)

    def status(self) -> dict:
        """For `status`: how many records are marked, and the first MAX_SHOWN of them."""
        records = self.records()
        return {"records": len(records), "shown": [r.to_json() for r in records[:MAX_SHOWN]]}
