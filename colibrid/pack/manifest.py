"""The pack manifest (``manifest.json``): what a pack contains and where.

Written last by the converter, so a pack without a manifest is incomplete by
definition. Readers reject versions they do not know.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from colibrid.models.config import ModelConfig

FORMAT_NAME = "colibri-pack"
FORMAT_VERSION = 1
MANIFEST_FILE = "manifest.json"
DENSE_FILE = "dense.bin"
EXPERTS_FILE = "experts.bin"
EXPERT_PARTS = ("gate", "up", "down")  # order of the projections inside an expert record
EXPERT_PART_ALIGN_BYTES = 64  # each projection starts on a cache-line boundary in its record
INDEX_COLUMNS = ("layer", "expert", "offset", "length", "crc32c")


class PackError(Exception):
    """A pack is missing, incomplete, corrupt or of an unknown format version."""


@dataclass(frozen=True)
class TensorEntry:
    type: str  # element type name: f32, f16, bf16, q8_0, q4_g64
    shape: tuple[int, ...]
    offset: int  # bytes from the start of its file (dense) or record (expert part)
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type, "shape": list(self.shape), "offset": self.offset, "nbytes": self.nbytes}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TensorEntry":
        return cls(data["type"], tuple(data["shape"]), int(data["offset"]), int(data["nbytes"]))


@dataclass(frozen=True)
class ExpertRecord:
    layer: int
    expert: int
    offset: int  # bytes from the start of experts.bin; a multiple of the alignment
    length: int  # bytes, padding included; a multiple of the alignment
    crc32c: int  # CRC-32C of all `length` bytes


@dataclass
class Manifest:
    model: ModelConfig
    quantization: dict[str, str]
    alignment: int
    dense_tensors: dict[str, TensorEntry]
    dense_size: int
    expert_parts: dict[str, TensorEntry]  # the layout shared by every expert record
    expert_records: list[ExpertRecord]
    experts_size: int
    tokenizer_files: list[str] = field(default_factory=list)
    source: dict[str, Any] = field(default_factory=dict)
    producer: str = ""

    @property
    def record_bytes(self) -> int:
        return max((r.length for r in self.expert_records), default=0)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "producer": self.producer,
            "source": self.source,
            "model": self.model.to_json(),
            "quantization": self.quantization,
            "alignment": self.alignment,
            "tokenizer_files": self.tokenizer_files,
            "dense": {
                "file": DENSE_FILE,
                "size": self.dense_size,
                "tensors": {name: t.to_json() for name, t in self.dense_tensors.items()},
            },
            "experts": {
                "file": EXPERTS_FILE,
                "size": self.experts_size,
                "record_bytes": self.record_bytes,
                "parts": {name: t.to_json() for name, t in self.expert_parts.items()},
                "index_columns": list(INDEX_COLUMNS),
                "index": [[r.layer, r.expert, r.offset, r.length, r.crc32c] for r in self.expert_records],
            },
        }

    def write(self, directory: Path) -> None:
        path = directory / MANIFEST_FILE
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def read(cls, directory: Path) -> "Manifest":
        path = directory / MANIFEST_FILE
        if not path.is_file():
            raise PackError(f"{directory} is not a Colibri pack (no {MANIFEST_FILE}); convert a checkpoint with colibri-convert")
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise PackError(f"{path}: unreadable manifest: {exc}") from None
        if data.get("format") != FORMAT_NAME:
            raise PackError(f"{path}: not a Colibri manifest (format={data.get('format')!r})")
        if data.get("format_version") != FORMAT_VERSION:
            raise PackError(
                f"{path}: pack format version {data.get('format_version')} is not supported "
                f"(this Colibri reads version {FORMAT_VERSION}); re-convert the checkpoint"
            )
        try:
            return cls._from_json(data)
        except (KeyError, TypeError, ValueError) as exc:
            raise PackError(f"{path}: malformed manifest: {exc!r}") from None

    @classmethod
    def _from_json(cls, data: dict[str, Any]) -> "Manifest":
        experts = data["experts"]
        if tuple(experts["index_columns"]) != INDEX_COLUMNS:
            raise ValueError(f"index_columns must be {list(INDEX_COLUMNS)}")
        return cls(
            model=ModelConfig.from_json(data["model"]),
            quantization=dict(data["quantization"]),
            alignment=int(data["alignment"]),
            dense_tensors={n: TensorEntry.from_json(t) for n, t in data["dense"]["tensors"].items()},
            dense_size=int(data["dense"]["size"]),
            expert_parts={n: TensorEntry.from_json(t) for n, t in experts["parts"].items()},
            expert_records=[ExpertRecord(*map(int, row)) for row in experts["index"]],
            experts_size=int(experts["size"]),
            tokenizer_files=list(data.get("tokenizer_files", [])),
            source=dict(data.get("source", {})),
            producer=data.get("producer", ""),
        )
