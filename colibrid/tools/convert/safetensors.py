"""A minimal, memory-mapped reader for Hugging Face safetensors checkpoints.

Reads one tensor at a time straight from the mapped file, so converting a model never
needs the whole checkpoint in RAM. Handles single files and sharded checkpoints with
``model.safetensors.index.json``. Every inconsistency is a :class:`CheckpointError`
naming the file (and tensor) involved.

Tensors published quantized read as their exact float32 values: F8_E4M3 weights with a
``<name>_scale_inv`` sibling get their block scales applied (convert/fp8.py), and a pair of
U8 tensors ``<name>_blocks`` / ``<name>_scales`` is one MXFP4 tensor ``<name>`` (dtype
"MXFP4", convert/mxfp4.py) that can also be read as the pack's mxfp4 rows, losslessly.
A :class:`TensorRef` addresses part of a tensor (one expert of a fused (E, R, C) tensor,
every other row), so a fused checkpoint tensor is never read whole.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from colibrid import native
from colibrid.models.tensor_ref import TensorRef, slice_rows
from colibrid.tools.convert import fp8, mxfp4

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit

_DTYPES = {"F32": (np.float32, 4), "F16": (np.float16, 2), "BF16": (np.uint16, 2), "F8_E4M3": (np.uint8, 1),
           "U8": (np.uint8, 1)}
MXFP4 = "MXFP4"  # the dtype of a <name>_blocks / <name>_scales pair, read as one tensor


class CheckpointError(Exception):
    """The checkpoint is missing a file or tensor, or a file is corrupt."""


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # safetensors dtype name: F32, F16, BF16, F8_E4M3, U8; or MXFP4 for a blocks/scales pair
    shape: tuple[int, ...]  # MXFP4: the values' shape (..., R, C), C = 32 x groups
    begin: int  # absolute byte offset in the file (MXFP4: of the blocks)
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


@dataclass(frozen=True)
class SourceMatrix:
    """A tensor (or part) as libcolibri's col_convert reads it: ``shape`` (N, C) elements of
    ``dtype`` stored contiguously at ``begin`` in ``file``, of which output rows ``rows``
    are taken; FP8 weights carry their ``scale_inv`` (float32, one factor per ``block``)."""

    file: Path
    begin: int
    shape: tuple[int, int]
    dtype: str
    rows: slice | None = None
    scale_inv: np.ndarray | None = None
    block: tuple[int, int] | None = None

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * _DTYPES[self.dtype][1]


class Checkpoint:
    """All tensors of a checkpoint directory, addressable by name (or :class:`TensorRef`).

    ``fp8_block`` is the (rows, cols) block of F8_E4M3 weights' ``_scale_inv`` tensors
    (``quantization_config.weight_block_size``; see convert/fp8.py)."""

    def __init__(self, directory: Path, fp8_block: tuple[int, int] = fp8.DEFAULT_BLOCK,
                 prefixes: dict[str, str] | None = None) -> None:
        """``prefixes``: renames of name prefixes (a multimodal wrapper's
        ``model.language_model.`` -> ``model.``), so the text model's tensors are found under
        the names its family module gives; applied before anything else looks at a name."""
        self.directory = directory
        self.fp8_block = fp8_block
        self.tensors: dict[str, TensorInfo] = {}
        self._mxfp4_parts: dict[str, tuple[TensorInfo, TensorInfo]] = {}  # name -> (blocks, scales)
        self._maps: dict[Path, np.memmap] = {}
        index = directory / INDEX_FILE
        if index.is_file():
            self._load_sharded(index)
        elif (directory / SINGLE_FILE).is_file():
            self.tensors = _read_header(directory / SINGLE_FILE)
        else:
            raise CheckpointError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors checkpoints are supported)")
        if prefixes:
            self._rename_prefixes(prefixes)
        self._pair_mxfp4()

    def _rename_prefixes(self, prefixes: dict[str, str]) -> None:
        renamed: dict[str, TensorInfo] = {}
        for name, info in self.tensors.items():
            new_name = next((to + name[len(old):] for old, to in prefixes.items() if name.startswith(old)), name)
            if new_name in renamed:
                raise CheckpointError(f"{self.directory}: tensor {new_name} is in the checkpoint twice "
                                      f"(once under a wrapper's prefix, {', '.join(prefixes)})")
            renamed[new_name] = info
        self.tensors = renamed

    def _pair_mxfp4(self) -> None:
        """Every ``X_blocks`` / ``X_scales`` pair of U8 tensors becomes the MXFP4 tensor X."""
        for blocks_name, blocks in list(self.tensors.items()):
            if not blocks_name.endswith("_blocks") or blocks.dtype != "U8":
                continue
            name = blocks_name[: -len("_blocks")]
            scales = self.tensors.get(name + "_scales")
            if scales is None or scales.dtype != "U8":
                continue
            if blocks.shape[:-1] != scales.shape or blocks.shape[-1:] != (mxfp4.GROUP // 2,) or not scales.shape:
                raise CheckpointError(f"{blocks.file}: MXFP4 tensor {name}: {blocks_name} {list(blocks.shape)} does not match "
                                      f"{name}_scales {list(scales.shape)} (expected scales' shape + [{mxfp4.GROUP // 2}])")
            shape = scales.shape[:-1] + (scales.shape[-1] * mxfp4.GROUP,)
            self.tensors[name] = TensorInfo(blocks.file, MXFP4, shape, blocks.begin, blocks.end)
            self._mxfp4_parts[name] = (blocks, scales)

    def _load_sharded(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: unreadable shard index ({exc!r})") from None
        by_shard: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            # a shard is a file of this directory: never a path that leads elsewhere
            if not isinstance(shard, str) or not shard or "/" in shard or "\\" in shard or shard in (".", ".."):
                raise CheckpointError(f"{index}: tensor {name!r} is mapped to {str(shard)[:80]!r}, not a file name")
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

    def shape_of(self, ref: "str | TensorRef") -> tuple[int, ...]:
        """The shape of a tensor or of the part a TensorRef names (CheckpointError if absent)."""
        ref = TensorRef.of(ref)
        shape = self.info(ref.name).shape
        if len(ref.index) >= len(shape) or any(not 0 <= i < n for i, n in zip(ref.index, shape)):
            raise CheckpointError(f"{ref}: index out of range for tensor {ref.name} of shape {list(shape)}")
        shape = shape[len(ref.index):]
        if ref.view is not None and math.prod(shape) == math.prod(ref.view):
            shape = ref.view
        if ref.transposed and len(shape) >= 2 and self.info(ref.name).dtype != MXFP4:
            shape = shape[:-2] + (shape[-1], shape[-2])
        if ref.rows is not None:
            n_rows = shape[0] if len(shape) == 1 else shape[-2]
            if isinstance(ref.rows, slice):
                taken = len(range(*ref.rows.indices(n_rows)))
            elif all(0 <= r < n_rows for r in ref.rows):
                taken = len(ref.rows)
            else:
                raise CheckpointError(f"{ref}: a row number is out of range for tensor {ref.name} of shape {list(shape)}")
            shape = (taken,) if len(shape) == 1 else shape[:-2] + (taken, shape[-1])
        return shape

    def has(self, ref: "str | TensorRef") -> bool:
        return TensorRef.of(ref).name in self.tensors

    def is_mxfp4(self, ref: "str | TensorRef") -> bool:
        info = self.tensors.get(TensorRef.of(ref).name)
        return info is not None and info.dtype == MXFP4

    def read_f32(self, ref: "str | TensorRef") -> np.ndarray:
        """The tensor (or part) as a new float32 array, exactly: bf16 and f16 widened, F8_E4M3
        decoded and multiplied by its block scales, MXFP4 decoded."""
        ref = TensorRef.of(ref)
        info = self.info(ref.name)
        self.shape_of(ref)  # checks the index
        if info.dtype == MXFP4:
            packed = self.read_mxfp4(ref)
            shape = self.shape_of(ref)
            rows = int(np.prod(shape[:-1], dtype=np.int64))
            return native.dequantize(native.TensorType.MXFP4, packed, rows, shape[-1]).reshape(shape)
        if info.dtype == "U8":
            raise CheckpointError(f"{info.file}: tensor {ref.name} holds raw bytes (U8), not values")
        raw = self._raw(info)
        if info.dtype == "F8_E4M3":
            return self._read_fp8(ref, info, raw)
        part = ref.select(raw)
        if info.dtype == "BF16":
            return (part.astype(np.uint32) << 16).view(np.float32)
        return part.astype(np.float32)

    def source_matrix(self, ref: "str | TensorRef") -> SourceMatrix | None:
        """Where the (R, C) matrix ``ref`` names lies in its file, for reading it raw and
        decoding it in libcolibri; None for what only read_f32 reads (vectors, MXFP4 values,
        tensors of more than two axes after the index, transposed parts)."""
        ref = TensorRef.of(ref)
        info = self.info(ref.name)
        self.shape_of(ref)  # checks the index
        if ref.transposed or isinstance(ref.rows, tuple):  # read_f32 transposes (gpt-oss's value experts)
            return None  # or gathers (rows interleaved per head): a few dense projections
        shape = self.shape_of(TensorRef(ref.name, ref.index, view=ref.view))  # (N, C) as stored, viewed
        if info.dtype not in ("F32", "F16", "BF16", "F8_E4M3") or len(shape) != 2:
            return None
        elem_bytes = _DTYPES[info.dtype][1]
        flat_index = int(np.ravel_multi_index(ref.index, info.shape[: len(ref.index)])) if ref.index else 0
        begin = info.begin + flat_index * shape[0] * shape[1] * elem_bytes
        matrix = SourceMatrix(info.file, begin, (shape[0], shape[1]), info.dtype, ref.rows)
        scale_name = ref.name + "_scale_inv"
        if info.dtype != "F8_E4M3" or scale_name not in self.tensors:
            return matrix
        scale = self.read_f32(TensorRef(scale_name, ref.index))
        if scale.size == 1:  # one factor for the whole tensor: one block
            return replace(matrix, scale_inv=scale.reshape(1, 1), block=(max(shape[0], 1), max(shape[1], 1)))
        b0, b1 = self.fp8_block
        grid = (-(-shape[0] // b0), -(-shape[1] // b1))
        if scale.shape != grid:
            raise CheckpointError(f"{info.file}: FP8 tensor {ref.name}: scale_inv has shape {list(scale.shape)}, "
                                  f"expected {list(grid)} for blocks of {b0}x{b1}")
        return replace(matrix, scale_inv=scale, block=(b0, b1))

    def read_source(self, matrix: SourceMatrix) -> np.ndarray:
        """The raw (N, C) elements of ``matrix`` in a new array, read with one pread (the
        GIL is released while the disk works: a reader thread overlaps the quantizer)."""
        out = np.empty(matrix.shape, dtype=_DTYPES[matrix.dtype][0])
        view = memoryview(out.reshape(-1).view(np.uint8))
        try:
            with open(matrix.file, "rb", buffering=0) as f:
                done = 0
                while done < len(view):
                    n = os.preadv(f.fileno(), [view[done:]], matrix.begin + done)
                    if n == 0:
                        raise CheckpointError(f"{matrix.file}: truncated (tensor data ends past the end of the file)")
                    done += n
        except OSError as exc:
            raise CheckpointError(f"{matrix.file}: cannot read: {exc.strerror}") from None
        return out

    def _read_fp8(self, ref: TensorRef, info: TensorInfo, raw: np.ndarray) -> np.ndarray:
        values = fp8.decode_e4m3(raw[ref.index] if ref.index else raw)  # (..., R, C) as stored: blocks span rows
        scale_name = ref.name + "_scale_inv"
        if scale_name in self.tensors:
            scale = self.read_f32(TensorRef(scale_name, ref.index))
            try:
                fp8.apply_block_scales(values, scale, self.fp8_block)
            except ValueError as exc:
                raise CheckpointError(f"{info.file}: FP8 tensor {ref.name}: {exc}") from None
        if ref.transposed and values.ndim >= 2:
            values = values.swapaxes(-1, -2)
        return np.ascontiguousarray(slice_rows(values, ref.rows))

    def read_mxfp4(self, ref: "str | TensorRef") -> np.ndarray:
        """An MXFP4 tensor (or part) (..., R, C) as the pack's mxfp4 rows (..., R, C / 32 * 17)
        uint8: the published bytes, rearranged (convert/mxfp4.py)."""
        ref = TensorRef.of(ref)
        self.shape_of(ref)
        if ref.name not in self._mxfp4_parts:
            raise CheckpointError(f"checkpoint {self.directory}: tensor {ref.name} is not MXFP4 (no {ref.name}_blocks / _scales)")
        blocks, scales = self._mxfp4_parts[ref.name]
        block_view = self._raw(blocks)  # (..., R, G, 16)
        block_part = block_view[ref.index] if ref.index else block_view
        if ref.rows is not None:
            block_part = block_part[..., ref.rows if isinstance(ref.rows, slice) else list(ref.rows), :, :]
        return mxfp4.pack_rows(block_part, ref.select(self._raw(scales), transpose=False))

    def _raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's stored elements, a read-only view of the mapped file."""
        return self._map(info.file)[info.begin : info.end].view(_DTYPES[info.dtype][0]).reshape(info.shape)

    def _map(self, path: Path) -> np.memmap:
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        return self._maps[path]
