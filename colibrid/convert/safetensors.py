"""A minimal, memory-mapped reader for Hugging Face safetensors checkpoints.

Reads one tensor at a time straight from the mapped file, so converting a model never
needs the whole checkpoint in RAM. Handles single files and sharded checkpoints with
``model.safetensors.index.json``. Every inconsistency is a :class:`CheckpointError`
naming the file (and tensor) involved.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit

_DTYPES = {"F32": (np.float32, 4), "F16": (np.float16, 2), "BF16": (np.uint16, 2)}


class CheckpointError(Exception):
    """The checkpoint is missing a file or tensor, or a file is corrupt."""


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # safetensors dtype name: F32, F16, BF16
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


def _read_header(path: Path) -> dict[str, TensorInfo]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: corrupt safetensors header (file shorter than 8 bytes)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise CheckpointError(f"{path}: corrupt safetensors header (declared length {header_len} bytes)")
            header_bytes = f.read(header_len)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        header = json.loads(header_bytes)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path}: corrupt safetensors header ({exc})") from None
    data_start = 8 + header_len
    tensors = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _tensor_info(path, name, meta, data_start, size)
    return tensors


def _tensor_info(path: Path, name: str, meta, data_start: int, size: int) -> TensorInfo:
    try:
        dtype, shape, (begin, end) = meta["dtype"], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: corrupt safetensors header entry for tensor {name!r}") from None
    if dtype not in _DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r} has dtype {dtype}; supported: {', '.join(_DTYPES)}")
    expected = int(np.prod(shape, dtype=np.int64)) * _DTYPES[dtype][1]
    if end - begin != expected or begin < 0 or data_start + end > size:
        raise CheckpointError(f"{path}: corrupt safetensors header: tensor {name!r} data range [{begin}, {end}) is inconsistent")
    return TensorInfo(path, dtype, shape, data_start + begin, data_start + end)


class Checkpoint:
    """All tensors of a checkpoint directory, addressable by name."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.tensors: dict[str, TensorInfo] = {}
        self._maps: dict[Path, np.memmap] = {}
        index = directory / INDEX_FILE
        if index.is_file():
            self._load_sharded(index)
        elif (directory / SINGLE_FILE).is_file():
            self.tensors = _read_header(directory / SINGLE_FILE)
        else:
            raise CheckpointError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors checkpoints are supported)")

    def _load_sharded(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: unreadable shard index ({exc!r})") from None
        by_shard: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            by_shard.setdefault(shard, []).append(name)
        for shard, names in sorted(by_shard.items()):
            path = self.directory / shard
            if not path.is_file():
                raise CheckpointError(f"missing shard {shard} (listed in {INDEX_FILE} for {len(names)} tensors, e.g. {names[0]})")
            header = _read_header(path)
            for name in names:
                if name not in header:
                    raise CheckpointError(f"{path}: tensor {name!r} listed in {INDEX_FILE} is not in the shard")
                self.tensors[name] = header[name]

    @property
    def source_dtypes(self) -> list[str]:
        return sorted({t.dtype for t in self.tensors.values()})

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"checkpoint {self.directory} lacks tensor {name}") from None

    def read_f32(self, name: str) -> np.ndarray:
        """The tensor as a new float32 array (bf16 and f16 widened exactly)."""
        info = self.info(name)
        mapped = self._map(info.file)
        np_dtype = _DTYPES[info.dtype][0]
        raw = mapped[info.begin : info.end].view(np_dtype).reshape(info.shape)
        if info.dtype == "BF16":
            return (raw.astype(np.uint32) << 16).view(np.float32)
        return raw.astype(np.float32)

    def _map(self, path: Path) -> np.memmap:
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        return self._maps[path]
