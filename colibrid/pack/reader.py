"""Open a pack: validate the manifest against the files, map the dense file, and
describe where each routed expert's record lives."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from colibrid import native
from colibrid.native import TensorType
from colibrid.pack.manifest import DENSE_FILE, EXPERT_PARTS, EXPERTS_FILE, ExpertRecord, Manifest, PackError
from colibrid.pack.tensor import PackedTensor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExpertWeights:
    """One routed expert, viewed inside its record's bytes."""

    gate: PackedTensor  # (F, D)
    up: PackedTensor  # (F, D)
    down: PackedTensor  # (D, F)

    @cached_property
    def kernel_buffers(self) -> native.ExpertBuffers | None:
        """The three matrices as libcolibri's fused expert call takes them, checked once per
        view (views of resident records and of cache slots live long); None when the parts
        are not all of one type (the converter never writes that)."""
        if not self.gate.type == self.up.type == self.down.type:
            return None
        ffn, dim = self.gate.shape
        return native.ExpertBuffers(self.gate.type, self.gate.data, self.up.data, self.down.data, dim, ffn)


class Pack:
    """A validated, opened pack. Dense tensors are read-only views of an mmap."""

    def __init__(self, path: Path, manifest: Manifest, dense: np.ndarray) -> None:
        self.path = path
        self.manifest = manifest
        self._dense = dense  # uint8 (dense_size,), memory-mapped read-only
        config = manifest.model
        self._records = np.full((config.num_layers, max(config.num_experts, 1)), -1, dtype=np.int64)
        for i, record in enumerate(manifest.expert_records):
            self._records[record.layer, record.expert] = i

    @classmethod
    def open(cls, path: str | Path) -> "Pack":
        path = Path(path)
        if not path.is_dir():
            raise PackError(f"pack {path} does not exist or is not a directory")
        manifest = Manifest.read(path)
        for name, expected in ((DENSE_FILE, manifest.dense_size), (EXPERTS_FILE, manifest.experts_size)):
            file = path / name
            if not file.is_file():
                raise PackError(f"pack {path} is incomplete: {name} is missing")
            actual = file.stat().st_size
            if actual != expected:
                raise PackError(f"pack {path} is damaged: {name} has {actual} bytes, manifest says {expected}")
        if manifest.dense_size == 0:
            raise PackError(f"pack {path} has an empty dense file")
        dense = np.memmap(path / DENSE_FILE, dtype=np.uint8, mode="r")
        pack = cls(path, manifest, dense)
        pack._check_expert_index()
        return pack

    @property
    def experts_path(self) -> Path:
        return self.path / EXPERTS_FILE

    def has_dense(self, name: str) -> bool:
        return name in self.manifest.dense_tensors

    def dense(self, name: str) -> PackedTensor:
        entry = self.manifest.dense_tensors.get(name)
        if entry is None:
            raise PackError(f"pack {self.path} lacks tensor {name!r}")
        raw = self._dense[entry.offset : entry.offset + entry.nbytes]
        return PackedTensor.from_bytes(TensorType.from_name(entry.type), entry.shape, raw)

    def expert_record(self, layer: int, expert: int) -> ExpertRecord:
        i = self._records[layer, expert] if 0 <= layer < self._records.shape[0] else -1
        if i < 0:
            raise PackError(f"pack {self.path} has no record for expert {expert} of layer {layer}")
        return self.manifest.expert_records[i]

    def expert_weights(self, record_bytes: np.ndarray) -> ExpertWeights:
        """View one record's bytes (uint8, at least the record's data) as an expert."""
        parts = {}
        for name in EXPERT_PARTS:
            entry = self.manifest.expert_parts[name]
            raw = record_bytes[entry.offset : entry.offset + entry.nbytes]
            parts[name] = PackedTensor.from_bytes(TensorType.from_name(entry.type), entry.shape, raw)
        return ExpertWeights(**parts)

    def _check_expert_index(self) -> None:
        config = self.manifest.model
        expected = len(config.moe_layer_ids) * config.num_experts
        if len(self.manifest.expert_records) != expected:
            raise PackError(
                f"pack {self.path}: expert index has {len(self.manifest.expert_records)} records, "
                f"the model needs {expected}"
            )
        for record in self.manifest.expert_records:
            if record.offset % self.manifest.alignment or record.offset + record.length > self.manifest.experts_size:
                raise PackError(f"pack {self.path}: expert record {record} lies outside experts.bin or is misaligned")
