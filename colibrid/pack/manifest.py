"""The pack manifest (``manifest.json``): what a pack contains and where.

Written last by the converter, so a pack without a manifest is incomplete by
definition. Readers reject versions they do not know.

A manifest is read as hostile input: every number must be a JSON integer (not a float,
a bool or a string) within bounds, every entry must have exactly its documented keys,
and the file itself is bounded in size. The checks against the model and the files are
in ``colibrid.pack.validate``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from colibrid.models.model_config import ModelConfig
from colibrid.models.optional_tensors import OPTIONAL_TENSORS, optional_tensors_in
from colibrid.native import TensorType
from colibrid.pack.durable import write_file_atomically
from colibrid.pack.layout import EXPERT_BIAS_PARTS, EXPERT_PARTS, TENSOR_CLASSES  # noqa: F401 (re-exported)

FORMAT_NAME = "colibri-pack"
FORMAT_VERSION = 2  # 2: every dense tensor entry carries its crc32c
# 3: experts.device, the experts region on a raw block device. Written only for such packs (a
# writer writes the lowest version that describes the pack), so file packs still open in
# readers that know version 2.
DEVICE_FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)  # version 1 packs load without dense checksums, with a warning
MANIFEST_FILE = "manifest.json"
DENSE_FILE = "dense.bin"
EXPERTS_FILE = "experts.bin"
EXPERT_PART_ALIGN_BYTES = 64  # each projection starts on a cache-line boundary in its record
INDEX_COLUMNS = ("layer", "expert", "offset", "length", "crc32c")

# A manifest of the largest MoE models (~60 layers x ~400 experts) is a few MB: far more is
# not a manifest, and must not cost the daemon its memory at start.
MAX_MANIFEST_BYTES = 64 << 20
MAX_FILE_BYTES = 1 << 50  # offsets and sizes: 1 PiB, far beyond any model, far below overflow
MAX_DIM = 1 << 31  # one tensor dimension
MAX_CRC32C = 0xFFFFFFFF
TYPE_NAMES = tuple(t.name_in_pack for t in TensorType)
TENSOR_KEYS = {"type", "shape", "offset", "nbytes", "crc32c"}
# The SHA-256 of each file (key "sha256": file name -> hex digest) and of the manifest's own
# content ("manifest_sha256"), recorded by the converter so a pack copied between machines can
# be proven identical (colibri-verify); on a device pack, experts.device.sha256 is the experts
# region's. Optional, and no new format version: packs written before have none, and a reader
# that loads a pack need not check them.
SHA256_KEY = "sha256"
MANIFEST_SHA256_KEY = "manifest_sha256"
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
DEVICE_KEYS = {"pack_id", "region_offset", "logical_block_size", "identity", SHA256_KEY}
MAX_IDENTITY_KEYS = 16
MAX_IDENTITY_TEXT = 4096


class PackError(Exception):
    """A pack is missing, incomplete, corrupt or of an unknown format version."""


@dataclass(frozen=True)
class TensorEntry:
    type: str  # element type name: f32, f16, bf16, q8_0, q4_g64
    shape: tuple[int, ...]
    offset: int  # bytes from the start of its file (dense) or record (expert part)
    nbytes: int
    crc32c: int | None = None  # CRC-32C of the nbytes bytes (dense tensors, format version 2)

    def to_json(self) -> dict[str, Any]:
        data = {"type": self.type, "shape": list(self.shape), "offset": self.offset, "nbytes": self.nbytes}
        if self.crc32c is not None:
            data["crc32c"] = self.crc32c
        return data

    @classmethod
    def from_json(cls, data: Any, where: str, needs_crc: bool) -> "TensorEntry":
        """Parse one entry; ``where`` names it in errors ("dense tensor 'embed' in dense.bin")."""
        _require_object(data, where)
        unknown = set(data) - TENSOR_KEYS
        if unknown:
            raise ValueError(f"{where} has unknown keys {sorted(unknown)}")
        type_name = _require(data, "type", where)
        if type_name not in TYPE_NAMES:
            raise ValueError(f"{where}: unknown type {type_name!r:.40} (types: {', '.join(TYPE_NAMES)})")
        shape = _require(data, "shape", where)
        if not isinstance(shape, list) or not 1 <= len(shape) <= 2:
            raise ValueError(f"{where}: shape must be a list of 1 or 2 dimensions, got {shape!r:.60}")
        dims = tuple(_integer(d, f"{where}: shape dimension", 1, MAX_DIM) for d in shape)
        crc = data.get("crc32c")
        if crc is None and needs_crc:
            raise ValueError(f"{where} has no crc32c (every dense tensor has one since format version 2)")
        return cls(
            type_name, dims,
            _integer(_require(data, "offset", where), f"{where}: offset"),
            _integer(_require(data, "nbytes", where), f"{where}: nbytes"),
            None if crc is None else _integer(crc, f"{where}: crc32c", 0, MAX_CRC32C),
        )


@dataclass(frozen=True)
class ExpertRecord:
    layer: int
    expert: int
    offset: int  # bytes from the start of experts.bin; a multiple of the alignment
    length: int  # bytes, padding included; a multiple of the alignment
    crc32c: int  # CRC-32C of all `length` bytes

    @classmethod
    def from_row(cls, row: Any, number: int) -> "ExpertRecord":
        where = f"{EXPERTS_FILE} index row {number}"
        if not isinstance(row, list) or len(row) != len(INDEX_COLUMNS):
            raise ValueError(f"{where} must be a list [{', '.join(INDEX_COLUMNS)}], got {row!r:.60}")
        layer, expert, offset, length, crc = row
        return cls(
            _integer(layer, f"{where}: layer", 0, MAX_DIM),
            _integer(expert, f"{where}: expert", 0, MAX_DIM),
            _integer(offset, f"{where}: offset"),
            _integer(length, f"{where}: length"),
            _integer(crc, f"{where}: crc32c", 0, MAX_CRC32C),
        )


@dataclass(frozen=True)
class ExpertsDevice:
    """experts.device: the experts region lives on a raw block device, after its superblock,
    instead of in experts.bin. The device is found by its superblock's pack id at open time;
    ``identity`` only says where to look first and what to tell the user to attach."""

    pack_id: str  # the UUID in the device's superblock, canonical lowercase form
    region_offset: int  # bytes from the device's start to record offset 0; a multiple of the alignment
    logical_block_size: int  # the device's, when the pack was written
    identity: dict[str, str | int] = field(default_factory=dict)  # name, size_bytes, partition, wwid, serial, model, loop_backing_file
    # SHA-256 (hex) of the region's experts.size bytes, the records in index order: what
    # experts.bin's entry in "sha256" is for a file pack. None: not recorded.
    sha256: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"pack_id": self.pack_id, "region_offset": self.region_offset,
                "logical_block_size": self.logical_block_size, "identity": dict(self.identity),
                **({SHA256_KEY: self.sha256} if self.sha256 is not None else {})}

    @classmethod
    def from_json(cls, data: Any) -> "ExpertsDevice":
        where = "experts.device"
        _require_object(data, where)
        unknown = set(data) - DEVICE_KEYS
        if unknown:
            raise ValueError(f"{where} has unknown keys {sorted(unknown)}")
        pack_id = _require(data, "pack_id", where)
        try:
            canonical = str(uuid.UUID(pack_id)) if isinstance(pack_id, str) else None
        except ValueError:
            canonical = None
        if canonical != pack_id:
            raise ValueError(f"{where}.pack_id must be a UUID in canonical form, got {pack_id!r:.60}")
        identity = _require_object(data.get("identity", {}), f"{where}.identity")
        if len(identity) > MAX_IDENTITY_KEYS or not all(
                isinstance(k, str) and len(k) <= 64 and (type(v) is int or (isinstance(v, str) and len(v) <= MAX_IDENTITY_TEXT))
                for k, v in identity.items()):
            raise ValueError(f"{where}.identity must map at most {MAX_IDENTITY_KEYS} names to short strings or integers")
        digest = data.get(SHA256_KEY)
        return cls(pack_id, _integer(_require(data, "region_offset", where), f"{where}.region_offset"),
                   _integer(_require(data, "logical_block_size", where), f"{where}.logical_block_size", 1, 1 << 30),
                   dict(identity), None if digest is None else _sha256_hex(digest, f"{where}.{SHA256_KEY}"))


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
    format_version: int = FORMAT_VERSION  # the version read; a manifest is written as 2, or 3 with experts_device
    experts_device: ExpertsDevice | None = None  # None: the records are in experts.bin
    file_sha256: dict[str, str] = field(default_factory=dict)  # pack file name -> SHA-256 (hex); {}: not recorded
    manifest_sha256: str | None = None  # as recorded in the file read (None: not recorded); write() computes it
    # What the manifest's model section says of the optional tensors (qkv_bias: true ...), as
    # read; validate checks the tables hold what it says. Written from the tables (to_json), so
    # that a reader from before ModelConfig lost these fields reads a new pack right.
    model_flags: dict[str, bool] = field(default_factory=dict)

    @property
    def optional_tensors(self) -> frozenset[str]:
        """The optional tensors (colibrid/models/optional_tensors.py) the model has: those the
        tables hold (validate checks that every layer that takes one holds it)."""
        return optional_tensors_in(self.dense_tensors, self.expert_parts)

    @property
    def record_bytes(self) -> int:
        return max((r.length for r in self.expert_records), default=0)

    @property
    def has_dense_checksums(self) -> bool:
        return all(entry.crc32c is not None for entry in self.dense_tensors.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": DEVICE_FORMAT_VERSION if self.experts_device else FORMAT_VERSION,
            "producer": self.producer,
            "source": self.source,
            "model": {**self.model.to_json(),
                      **{name: name in self.optional_tensors for name in OPTIONAL_TENSORS}},
            "quantization": self.quantization,
            "alignment": self.alignment,
            "tokenizer_files": self.tokenizer_files,
            "dense": {
                "file": DENSE_FILE,
                "size": self.dense_size,
                "tensors": {name: t.to_json() for name, t in self.dense_tensors.items()},
            },
            "experts": {
                "file": None if self.experts_device else EXPERTS_FILE,
                **({"device": self.experts_device.to_json()} if self.experts_device else {}),
                "size": self.experts_size,
                "record_bytes": self.record_bytes,
                "parts": {name: t.to_json() for name, t in self.expert_parts.items()},
                "index_columns": list(INDEX_COLUMNS),
                "index": [[r.layer, r.expert, r.offset, r.length, r.crc32c] for r in self.expert_records],
            },
            **({SHA256_KEY: dict(self.file_sha256)} if self.file_sha256 else {}),
        }

    def write(self, directory: Path) -> None:
        """Write (or replace) manifest.json durably: it appears whole or not at all. The last key
        is the SHA-256 of everything before it (manifest_content_sha256)."""
        data = self.to_json()
        data[MANIFEST_SHA256_KEY] = manifest_content_sha256(data)
        text = json.dumps(data, indent=1) + "\n"
        write_file_atomically(directory / MANIFEST_FILE, text.encode())

    @classmethod
    def read(cls, directory: Path) -> "Manifest":
        return cls.from_data(read_manifest_data(directory), directory / MANIFEST_FILE)

    @classmethod
    def from_data(cls, data: Any, path: Path) -> "Manifest":
        """The manifest held by ``data`` (manifest.json parsed by read_manifest_data)."""
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise PackError(f"{path}: not a Colibri manifest (format={found!r:.40})")
        version = data.get("format_version")
        if type(version) is not int or version not in READABLE_VERSIONS:
            raise PackError(
                f"{path}: pack format version {version!r:.20} is not supported "
                f"(this Colibri reads versions {', '.join(map(str, READABLE_VERSIONS))}); re-convert the checkpoint"
            )
        try:
            return cls._from_json(data, version)
        except (KeyError, TypeError, ValueError) as exc:
            raise PackError(f"{path}: malformed manifest: {exc}") from None

    @classmethod
    def _from_json(cls, data: dict[str, Any], version: int) -> "Manifest":
        dense = _require_object(_require(data, "dense", "manifest"), "dense")
        experts = _require_object(_require(data, "experts", "manifest"), "experts")
        if _require(experts, "index_columns", "experts") != list(INDEX_COLUMNS):
            raise ValueError(f"experts.index_columns must be {list(INDEX_COLUMNS)}")
        tensors = _require_object(_require(dense, "tensors", "dense"), "dense.tensors")
        parts = _require_object(_require(experts, "parts", "experts"), "experts.parts")
        index = _require(experts, "index", "experts")
        if not isinstance(index, list):
            raise ValueError("experts.index must be a list of rows")
        model = dict(_require_object(_require(data, "model", "manifest"), "model"))
        model_flags = _model_flags(model)
        return cls(
            model=ModelConfig.from_json(model),
            quantization=_quantization(_require(data, "quantization", "manifest")),
            alignment=_integer(_require(data, "alignment", "manifest"), "alignment", 1, MAX_FILE_BYTES),
            dense_tensors={
                name: TensorEntry.from_json(t, f"dense tensor {name!r:.80} in {DENSE_FILE}", needs_crc=version >= 2)
                for name, t in tensors.items()
            },
            dense_size=_integer(_require(dense, "size", "dense"), f"dense.size ({DENSE_FILE})"),
            expert_parts={
                name: TensorEntry.from_json(t, f"expert part {name!r:.40} in {EXPERTS_FILE}", needs_crc=False)
                for name, t in parts.items()
            },
            expert_records=[ExpertRecord.from_row(row, i) for i, row in enumerate(index)],
            experts_size=_integer(_require(experts, "size", "experts"), f"experts.size ({EXPERTS_FILE})"),
            tokenizer_files=_file_names(data.get("tokenizer_files", [])),
            source=_require_object(data.get("source", {}), "source"),
            producer=str(data.get("producer", "")),
            format_version=version,
            experts_device=_experts_device(experts, version),
            file_sha256=_sha256_map(data.get(SHA256_KEY, {})),
            manifest_sha256=None if data.get(MANIFEST_SHA256_KEY) is None else
            _sha256_hex(data[MANIFEST_SHA256_KEY], MANIFEST_SHA256_KEY),
            model_flags=model_flags,
        )


def _model_flags(model: dict[str, Any]) -> dict[str, bool]:
    """Takes the optional-tensor flags out of a manifest's ``model`` section (docs/format.md,
    "Optional tensors"): name -> true or false, each as stated; ModelConfig has no such field."""
    flags = {}
    for name in OPTIONAL_TENSORS:
        if name in model:
            value = model.pop(name)
            if type(value) is not bool:
                raise ValueError(f"model.{name} must be true or false, got {value!r:.40}")
            flags[name] = value
    return flags


def manifest_content_sha256(data: dict[str, Any]) -> str:
    """SHA-256 of a manifest's content: of its canonical JSON (keys sorted, no spaces, ASCII)
    without the manifest_sha256 key. Canonical, so the digest survives re-indenting but not a
    changed value: a flipped byte either breaks the JSON or changes the digest."""
    content = {key: value for key, value in data.items() if key != MANIFEST_SHA256_KEY}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def read_manifest_data(directory: Path) -> Any:
    """manifest.json of the pack at ``directory`` parsed strictly (bounded, UTF-8, no duplicate
    keys, no NaN): PackError otherwise. Manifest.from_data checks what it holds."""
    path = directory / MANIFEST_FILE
    text = _read_manifest_text(path, directory)
    try:
        return json.loads(text, object_pairs_hook=_object_without_duplicates, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError; deep nesting recurses
        raise PackError(f"{path}: unreadable manifest: {exc}") from None


def _read_manifest_text(path: Path, directory: Path) -> str:
    """The manifest's text: a regular file (not followed through a symlink), bounded in size."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise PackError(
            f"{directory} is not a Colibri pack (no {MANIFEST_FILE}); convert a checkpoint with colibri-convert"
        ) from None
    except OSError as exc:
        raise PackError(f"{path}: cannot open the manifest: {exc.strerror}") from None
    with open(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise PackError(f"{path} is not a regular file")
        if info.st_size > MAX_MANIFEST_BYTES:
            raise PackError(f"{path} has {info.st_size} bytes; a manifest has at most {MAX_MANIFEST_BYTES}")
        raw = f.read(MAX_MANIFEST_BYTES + 1)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise PackError(f"{path} grew past {MAX_MANIFEST_BYTES} bytes while being read")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PackError(f"{path}: unreadable manifest: not UTF-8 ({exc.reason} at byte {exc.start})") from None


def _experts_device(experts: dict[str, Any], version: int) -> ExpertsDevice | None:
    device = experts.get("device")
    if device is None:
        if experts.get("file", EXPERTS_FILE) != EXPERTS_FILE:
            raise ValueError(f"experts.file must be {EXPERTS_FILE!r} (or null, with experts.device)")
        return None
    if version < DEVICE_FORMAT_VERSION:
        raise ValueError(f"experts.device needs format version {DEVICE_FORMAT_VERSION}, the manifest says {version}")
    if experts.get("file") is not None:
        raise ValueError("experts.file must be null when experts.device says the records are on a device")
    return ExpertsDevice.from_json(device)


# --- strict readers for JSON values ---


def _object_without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json object hook: a key given twice is ambiguous (which one did the writer mean?)."""
    result = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"key {key!r:.80} appears twice in one object")
        result[key] = value
    return result


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a manifest may hold")


def _require_object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(value).__name__}")
    return value


def _require(data: dict[str, Any], key: str, where: str) -> Any:
    if key not in data:
        raise ValueError(f"{where} lacks {key!r}")
    return data[key]


def _integer(value: Any, what: str, low: int = 0, high: int = MAX_FILE_BYTES) -> int:
    """A JSON integer in [low, high]. Floats (4096.0), bools and strings are refused rather
    than converted: a writer that produced them is not the writer this format describes."""
    if type(value) is not int:
        raise ValueError(f"{what} must be an integer, got {value!r:.40}")
    if not low <= value <= high:
        raise ValueError(f"{what} is {value}, outside [{low}, {high}]")
    return value


def _quantization(value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or set(value) != set(TENSOR_CLASSES):
        raise ValueError(f"quantization must map exactly {list(TENSOR_CLASSES)} to a type, got {value!r:.80}")
    for cls, type_name in value.items():
        if type_name not in TYPE_NAMES:
            raise ValueError(f"quantization of {cls}: unknown type {type_name!r:.40}")
    return dict(value)


def _sha256_hex(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _SHA256_HEX.fullmatch(value):
        raise ValueError(f"{what} must be a SHA-256 digest (64 lowercase hex digits), got {value!r:.80}")
    return value


def _sha256_map(value: Any) -> dict[str, str]:
    """sha256: plain file names of the pack (never a path that leads out of it) -> digest."""
    _require_object(value, SHA256_KEY)
    _file_names(list(value))
    return {name: _sha256_hex(digest, f"{SHA256_KEY} of {name}") for name, digest in value.items()}


def _file_names(value: Any, what: str = "tokenizer_files") -> list[str]:
    """tokenizer_files: plain names inside the pack, never a path that leads out of it."""
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a list of file names")
    for name in value:
        if not isinstance(name, str) or not name or "/" in name or "\0" in name or name.startswith("."):
            raise ValueError(f"{what}: {name!r:.80} is not a plain file name")
    return list(value)
