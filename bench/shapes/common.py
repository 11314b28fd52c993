"""What every benchmark shape shares: the Shape description, random weights written as a
Hugging Face safetensors checkpoint (bf16, FP8 e4m3 with block scales, MXFP4 bytes), and a
GGUF written tensor by tensor with the same values for llama.cpp."""

from __future__ import annotations

import json
import os
import struct
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any, Callable

import numpy as np

WEIGHT_STD = 0.05
SHARD_BYTES = 4 << 30


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Variant:
    """One pair of files measured against each other: a pack converted with ``quant`` and a
    GGUF whose quantized tensors are ``gguf_type``."""

    name: str  # in file names and --quant
    quant: str  # colibri-convert --quant
    gguf_type: str  # GGML type of the GGUF's matrices (published MXFP4 experts stay MXFP4)
    gguf_name: str = ""  # in the GGUF's file name and the results, when not gguf_type

    @property
    def gguf_label(self) -> str:
        return self.gguf_name or self.gguf_type


@dataclass(frozen=True)
class Shape:
    """A model shape: its Hugging Face config, its checkpoint tensors and its GGUF."""

    name: str
    description: str  # one line for the results header
    default_layers: int
    variants: tuple[Variant, ...]
    default_variants: tuple[str, ...]  # measured without --quant
    hf_config: Callable[[int], dict[str, Any]]  # layers -> config.json
    checkpoint_tensors: Callable[[dict], dict[str, "TensorSpec"]]  # config -> name -> spec, in file order
    write_gguf: Callable[[Path, Path, Variant, dict], None]  # (checkpoint, out, variant, config)
    legacy_prefix: str | None = None  # OLMoE's checkpoint directory predates shapes: "checkpoint"

    def variant(self, name: str) -> Variant:
        return next(v for v in self.variants if v.name == name)


# --------------------------------------------------------------------------------------------
# Random tensors, deterministic per name
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    dtype: str  # safetensors dtype: BF16, F32, F8_E4M3, U8
    shape: tuple[int, ...]
    fill: Callable[[str, tuple[int, ...]], np.ndarray] = field(repr=False)  # (name, shape) -> stored elements

    @property
    def nbytes(self) -> int:
        return {"BF16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1}[self.dtype] * int(np.prod(self.shape))


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()))


CHUNK_VALUES = 1 << 24  # drawn at a time: a 579 M-value embedding never sits in RAM as float32


def _chunked(shape: tuple[int, ...], dtype, draw: Callable[[int], np.ndarray]) -> np.ndarray:
    """An array of ``shape`` filled CHUNK_VALUES at a time by draw(count)."""
    out = np.empty(shape, dtype=dtype)
    flat = out.reshape(-1)
    for begin in range(0, flat.size, CHUNK_VALUES):
        end = min(begin + CHUNK_VALUES, flat.size)
        flat[begin:end] = draw(end - begin)
    return out


def to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), rounded to nearest even; overwrites ``values``."""
    bits = values.view(np.uint32)
    bits += 0x7FFF + ((bits >> 16) & 1)
    bits >>= 16
    return bits.astype(np.uint16)


def _normal_bf16(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """N(0, WEIGHT_STD) as bf16 bits. The normal draws in chunks give the stream one call
    would (numpy's Generator), so OLMoE's checkpoint is the one earlier versions wrote."""
    rng = _rng(name)

    def draw(count: int) -> np.ndarray:
        values = rng.standard_normal(count, dtype=np.float32)
        values *= np.float32(WEIGHT_STD)
        return to_bf16_bits(values)

    return _chunked(shape, np.uint16, draw)


def random_bf16(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """N(0, WEIGHT_STD) as bf16 bits (uint16); 1-D tensors (norms) are ones."""
    if len(shape) == 1:
        return to_bf16_bits(np.ones(shape, np.float32))
    return _normal_bf16(name, shape)


def random_bf16_vector(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """N(0, WEIGHT_STD) as bf16 bits for vectors too (biases, sinks), where ones would hide them."""
    return _normal_bf16(name, shape)


def random_f32_vector(name: str, shape: tuple[int, ...]) -> np.ndarray:
    return _rng(name).standard_normal(shape, dtype=np.float32) * np.float32(WEIGHT_STD)


# FP8: codes drawn so that their values follow N(0, FP8_CODE_STD), then one block scale
# WEIGHT_STD / FP8_CODE_STD everywhere: weights N(0, WEIGHT_STD) in e4m3's 3-bit precision.
FP8_CODE_STD = 64.0


def _normal_e4m3_codes() -> np.ndarray:
    """(65536) uint8: e4m3 codes; indexed by a uniform 16-bit number, their values follow
    N(0, FP8_CODE_STD) (the normal's quantiles rounded to the nearest e4m3 value). Uniform
    bytes looked up here are ~20x faster than drawing normals and rounding them."""
    from colibrid.tools.convert.fp8 import E4M3_VALUES

    quantiles = (np.arange(65536) + 0.5) / 65536
    normal = NormalDist(0.0, FP8_CODE_STD)
    wanted = np.array([normal.inv_cdf(q) for q in quantiles])
    positive = E4M3_VALUES[:0x7F].astype(np.float64)  # codes 0..126: 0 .. 448, ascending
    magnitude = np.minimum(np.abs(wanted), positive[-1])
    upper = np.clip(np.searchsorted(positive, magnitude), 1, len(positive) - 1)
    nearest = np.where(magnitude - positive[upper - 1] <= positive[upper] - magnitude, upper - 1, upper)
    return (nearest | np.where(wanted < 0, 0x80, 0)).astype(np.uint8)


_E4M3_LUT: np.ndarray | None = None


def random_fp8(name: str, shape: tuple[int, ...]) -> np.ndarray:
    global _E4M3_LUT
    if _E4M3_LUT is None:
        _E4M3_LUT = _normal_e4m3_codes()
    rng, lut = _rng(name), _E4M3_LUT
    return _chunked(shape, np.uint8, lambda count: lut[rng.integers(0, 65536, size=count, dtype=np.uint16)])


def fp8_scale_inv(name: str, shape: tuple[int, ...]) -> np.ndarray:
    return np.full(shape, WEIGHT_STD / FP8_CODE_STD, dtype=np.float32)


def fp8_weight(name: str, rows: int, cols: int, block: int = 128) -> dict[str, TensorSpec]:
    """A linear weight as DeepSeek-V3 publishes it: e4m3 codes and float32 block scales."""
    grid = (-(-rows // block), -(-cols // block))
    return {name: TensorSpec("F8_E4M3", (rows, cols), random_fp8),
            name + "_scale_inv": TensorSpec("F32", grid, fp8_scale_inv)}


def random_mxfp4_blocks(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Uniform e2m1 codes, two per byte (RMS value 2.9)."""
    rng = _rng(name)
    return _chunked(shape, np.uint8, lambda count: rng.integers(0, 256, size=count, dtype=np.uint8))


def random_mxfp4_scales(name: str, shape: tuple[int, ...]) -> np.ndarray:
    """e8m0 exponents 2^-7 .. 2^-5 per group of 32: weights of RMS ~0.05, as WEIGHT_STD."""
    return _rng(name).integers(127 - 7, 127 - 5 + 1, size=shape, dtype=np.uint8)


# --------------------------------------------------------------------------------------------
# The checkpoint: sharded safetensors with an index, as published checkpoints are
# --------------------------------------------------------------------------------------------


def write_checkpoint(directory: Path, config: dict, tensors: dict[str, TensorSpec]) -> None:
    from colibrid.tools.demo import write_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    write_tokenizer(directory)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    shards, current, size = [], [], 0
    for name, spec in tensors.items():
        if current and size + spec.nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += spec.nbytes
    shards.append(current)
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for name in names:
            spec = tensors[name]
            header[name] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
            weight_map[name] = file
        header_bytes = json.dumps(header).encode()
        header_bytes += b" " * (-len(header_bytes) % 8)
        with open(directory / (file + ".tmp"), "wb") as f:
            f.write(struct.pack("<Q", len(header_bytes)))
            f.write(header_bytes)
            for name in names:
                data = tensors[name].fill(name, tensors[name].shape)
                assert data.nbytes == tensors[name].nbytes, name
                f.write(np.ascontiguousarray(data).data)
        os.replace(directory / (file + ".tmp"), directory / file)
        log(f"checkpoint shard {i + 1}/{len(shards)}")
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def open_checkpoint(directory: Path):
    """The checkpoint through Colibri's own reader: read_f32 gives every tensor's values
    exactly (bf16 widened, FP8 times its block scales), read_mxfp4 the MXFP4 bytes."""
    from colibrid.tools.convert.safetensors import Checkpoint

    return Checkpoint(directory)


# --------------------------------------------------------------------------------------------
# GGUF, written one tensor at a time (a DeepSeek-V3 expert tensor is GBs as float32)
# --------------------------------------------------------------------------------------------


def import_gguf():
    """The ``gguf`` package: installed, or the copy in the llama.cpp tree bench/build_llama_cpp.sh
    unpacked (the same version as the llama-bench it builds)."""
    try:
        import gguf
    except ImportError:
        root = Path(os.environ.get("LLAMA_CPP_DIR", Path.home() / ".cache" / "colibri-bench" / "llama.cpp"))
        trees = sorted(root.glob("llama_cpp_python-*/vendor/llama.cpp/gguf-py"))
        if not trees:
            raise SystemExit("the gguf package is needed: run bench/build_llama_cpp.sh (it unpacks llama.cpp's "
                             "gguf-py) or install gguf") from None
        sys.path.insert(0, str(trees[-1]))
        import gguf
    return gguf


@dataclass
class GgufTensor:
    name: str
    shape: tuple[int, ...]  # numpy order: rows last-but-one, values along the last axis
    qtype: str  # GGML type name: F32, Q8_0, Q4_0, MXFP4
    make: Callable[[], np.ndarray]  # -> float32 values of `shape`, or the encoded bytes (uint8)


def quantize(values: np.ndarray, qtype: str) -> np.ndarray:
    """float32 values (..., C) -> the GGML type's bytes (..., C / block * block bytes)."""
    gguf = import_gguf()
    from colibrid import native

    if qtype == "F32":
        return np.ascontiguousarray(values, dtype=np.float32)
    rows = values.reshape(-1, values.shape[-1])
    if qtype == "Q8_0":  # Colibri's q8_0 is byte-identical to GGML's Q8_0, and faster than numpy
        encoded = native.quantize("q8_0", rows)
    else:
        encoded = gguf.quants.quantize(rows, getattr(gguf.GGMLQuantizationType, qtype))
    return encoded.reshape(*values.shape[:-1], -1)


def stacked(count: int, one: Callable[[int], np.ndarray], qtype: str) -> Callable[[], np.ndarray]:
    """make() of an expert tensor (E, rows, cols): each expert read and encoded in turn into
    one array of encoded bytes, so only one expert is float32 at a time."""

    def make() -> np.ndarray:
        out = None
        for e in range(count):
            encoded = quantize(one(e), qtype)
            if out is None:
                out = np.empty((count,) + encoded.shape, dtype=encoded.dtype)
            out[e] = encoded
        return out

    return make


def from_checkpoint(ckpt, gguf_name: str, hf_name: str, qtype: str) -> GgufTensor:
    """A GGUF tensor with the values of one checkpoint tensor, encoded as ``qtype``."""
    return GgufTensor(gguf_name, ckpt.shape_of(hf_name), qtype, lambda: ckpt.read_f32(hf_name))


def experts_from_checkpoint(ckpt, gguf_name: str, hf_name: Callable[[int], str], count: int, qtype: str) -> GgufTensor:
    """The (E, rows, cols) GGUF tensor of one projection of ``count`` per-expert checkpoint
    tensors (hf_name(expert) names each)."""
    rows, cols = ckpt.shape_of(hf_name(0))
    return GgufTensor(gguf_name, (count, rows, cols), qtype, stacked(count, lambda e: ckpt.read_f32(hf_name(e)), qtype))


def gguf_nbytes(shape: tuple[int, ...], qtype: str) -> int:
    gguf = import_gguf()
    if qtype == "F32":
        return 4 * int(np.prod(shape))
    byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, getattr(gguf.GGMLQuantizationType, qtype))
    return int(np.prod(byte_shape))


FIRST_TEXT_ID = 3  # after <unk>, <s>, </s>
FIRST_TEXT_CODE_POINT = 0x10000  # past the surrogates: every id maps to a valid character


def placeholder_piece(token_id: int) -> str:
    """The text of a placeholder token: one code point of its own, so a string of them
    tokenizes back to exactly those ids and any generated id reads back from the text
    (bench/greedy_agreement.py relies on both)."""
    return chr(FIRST_TEXT_CODE_POINT + token_id - FIRST_TEXT_ID)


def placeholder_id(piece: str) -> int:
    return ord(piece) - FIRST_TEXT_CODE_POINT + FIRST_TEXT_ID


def add_placeholder_vocab(writer, vocab_size: int) -> None:
    """A SentencePiece vocabulary of the model's size (llama-bench feeds random ids): ids
    0, 1, 2 are <unk>, <s>, </s>, then one character per id (no byte tokens: llama.cpp only
    warns that it has no newline token); no BOS added, no space prefix, so a prompt of those
    characters is exactly its ids."""
    tokens = ["<unk>", "<s>", "</s>"] + [placeholder_piece(i) for i in range(FIRST_TEXT_ID, vocab_size)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * vocab_size)
    writer.add_token_types([2, 3, 3] + [1] * (vocab_size - FIRST_TEXT_ID))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_add_space_prefix(False)


def write_gguf_file(out: Path, arch: str, metadata: Callable[[Any], None], tensors: list[GgufTensor]) -> None:
    """The header and tensor table first (sizes known from shapes), then each tensor's data
    as make() computes it, so memory holds one tensor at a time."""
    gguf = import_gguf()
    tmp = Path(str(out) + ".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    metadata(writer)
    for t in tensors:
        raw = None if t.qtype == "F32" else getattr(gguf.GGMLQuantizationType, t.qtype)
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), gguf_nbytes(t.shape, t.qtype), raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for i, t in enumerate(tensors):
        data = t.make()
        if data.dtype != np.uint8:
            data = quantize(data, t.qtype)
        writer.write_tensor_data(np.ascontiguousarray(data))
        if t.name.endswith("_exps.weight") or i == len(tensors) - 1:
            log(f"gguf {out.name}: {i + 1}/{len(tensors)} tensors ({t.name})")
    writer.close()
    os.replace(tmp, out)
