"""Convert a Hugging Face MoE checkpoint directory into a Colibri pack.

Order of work: read and check everything that can be checked cheaply (config,
architecture, every tensor's presence and shape) before writing a byte; then stream
tensor by tensor into a temporary directory that is renamed into place only when the
manifest is written. A reader thread reads the next tensor while libcolibri decodes and
quantizes the current one on the worker pool (col_convert) and a writer thread appends the
previous one to the pack: a few tensors in RAM at a time (convert/reader.py), every core busy.
"""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from colibrid import __version__, native
from colibrid.tools.convert import fp8
from colibrid.tools.convert.progress import Progress
from colibrid.tools.convert.reader import LoadedTensor, ReadRequest, TensorReader
from colibrid.tools.convert.quant_spec import QuantSpec
from colibrid.tools.convert.safetensors import Checkpoint, CheckpointError, TensorRef
from colibrid.tools.convert.tiktoken_tokenizer import TIKTOKEN_FILE, TiktokenError, convert_tiktoken
from colibrid.tools.convert.wrapped import TEXT_MODEL_PREFIXES, text_model_config
from colibrid.models import ARCHITECTURES, Architecture, UnsupportedArchitecture, UnsupportedConfig, architecture_for
from colibrid.models.model_config import ModelConfig
from colibrid.blockdev.safety import DeviceRefused, WritableDevice, WriteOptions, open_for_writing
from colibrid.blockdev.superblock import SUPERBLOCK_BLOCK_BYTES
from colibrid.pack.layout import (expected_dense_shape, expected_expert_shapes, expert_part_names, expert_part_type,
                                  requested_type, tensor_nbytes)
from colibrid.pack.manifest import EXPERT_PART_ALIGN_BYTES
from colibrid.pack.writer import PackWriter

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
REQUIRED_TOKENIZER_FILES = (TOKENIZER_FILE,)  # or TIKTOKEN_FILE, converted into it
OPTIONAL_TOKENIZER_FILES = (
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


class ConversionError(Exception):
    """A conversion failed; the message is one line that says why."""


@dataclass
class ConversionReport:
    out: Path
    architecture: str
    dense_bytes: int = 0
    experts_bytes: int = 0
    num_expert_records: int = 0
    fallbacks: list[str] = field(default_factory=list)  # tensors stored wider than asked
    quantization: dict[str, str] = field(default_factory=dict)  # type per class as written (MXFP4 experts kept)
    params: int = 0  # values read from the checkpoint
    peak_read_bytes: int = 0  # most source bytes the reader held at once (read ahead + being encoded)
    seconds: float = 0.0
    device: str | None = None  # "/dev/X (pack id ...)" when the experts went to a raw block device


class WriteBehind:
    """Runs the pack writer's appends on a thread of its own, one at a time and in order, so
    the disk writes one tensor while the pool quantizes the next. At most one append waits:
    submitting the next first waits for the previous (memory stays one encoded tensor ahead),
    and an append's error is raised there, or by ``drain``."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="colibri-convert-writer")
        self._pending: Future | None = None

    def submit(self, fn, *args) -> None:
        self.drain()
        self._pending = self._executor.submit(fn, *args)

    def drain(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def __enter__(self) -> "WriteBehind":
        return self

    def __exit__(self, *exc) -> None:
        try:
            if exc[0] is None:
                self.drain()
        finally:
            self._executor.shutdown(wait=True)


class Converter:
    def __init__(self, src: Path, out: Path, quant: QuantSpec, align: int, force: bool, progress: bool | None = None,
                 tokenizer_pattern: str | None = None, pool: native.ThreadPool | None = None,
                 device: str | None = None, device_options: WriteOptions | None = None) -> None:
        self.src, self.out, self.quant, self.align, self.force = src, out, quant, align, force
        self.device = device  # --device: the experts region goes to this raw block device
        self.device_options = device_options or WriteOptions(replace_pack=force)
        self.pool = pool  # quantizes on; None: native.default_pool(), one thread per CPU
        self.progress_enabled = progress
        self.tokenizer_pattern = tokenizer_pattern  # --tokenizer-pattern, for a tiktoken tokenizer
        self.converted_tokenizer_json: str | None = None  # tokenizer.json built from tiktoken.model
        text_model = text_model_config(self._read_config(), self._is_supported)
        self.hf_config, self.wrapper = text_model.config, text_model.wrapper
        try:
            self.arch: Architecture = architecture_for(self.hf_config)
            self.config: ModelConfig = self.arch.model_config(self.hf_config)
        except UnsupportedArchitecture as exc:
            raise ConversionError(f"{exc} (the text model of {self.wrapper!r})" if self.wrapper else str(exc)) from None
        except UnsupportedConfig as exc:
            raise ConversionError(f"{self.arch.name}: {exc}") from None
        except (KeyError, TypeError, ValueError) as exc:
            raise ConversionError(f"{src / 'config.json'}: cannot read the model configuration ({exc!r})") from None
        self.checkpoint = self._open_checkpoint()
        self.arch = self.arch.for_checkpoint(self.config, self.checkpoint.has)
        self.optional = self.arch.optional_tensors(self.hf_config)  # biases, sinks ... the checkpoint holds
        self.dense_names = self.arch.dense_tensor_names(self.config, self.optional)
        self.zero_centred = set(self.arch.zero_centred_norms(self.config))  # stored as 1 + w
        self.quant = self._experts_as_published(quant)
        self.report = ConversionReport(out, self.arch.name, quantization=self.quant.to_json())

    @staticmethod
    def _is_supported(model_type) -> bool:
        return any(model_type in arch.hf_model_types for arch in ARCHITECTURES.values())

    def _experts_as_published(self, quant: QuantSpec) -> QuantSpec:
        """Experts published as MXFP4 stay mxfp4 (their bytes are copied: lossless, and
        re-quantizing 4.25-bit weights to another 4-bit type would only lose accuracy)
        unless --quant names an experts type, which then re-encodes their exact values."""
        if "experts" in quant.explicit or not self.config.moe_layer_ids:
            return quant
        first = self.arch.expert_tensor_names(self.config.moe_layer_ids[0], 0).gate
        if not self.checkpoint.is_mxfp4(first):
            return quant
        log.info("experts are MXFP4 in the checkpoint: copied as mxfp4 (--quant experts=TYPE re-encodes them)")
        return quant.with_type("experts", native.TensorType.MXFP4)

    def _read_config(self) -> dict:
        path = self.src / "config.json"
        if not self.src.is_dir():
            raise ConversionError(f"{self.src} is not a directory")
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            raise ConversionError(f"{path} is missing; SRC must be a Hugging Face checkpoint directory") from None
        except (OSError, ValueError) as exc:
            raise ConversionError(f"{path}: unreadable ({exc})") from None

    def _open_checkpoint(self) -> Checkpoint:
        try:
            block = fp8.block_size(self.hf_config)
        except ValueError as exc:
            raise ConversionError(f"{self.src / 'config.json'}: {exc}") from None
        try:
            return Checkpoint(self.src, fp8_block=block, prefixes=TEXT_MODEL_PREFIXES if self.wrapper else None)
        except CheckpointError as exc:
            raise ConversionError(f"{self.arch.name} checkpoint: {exc}") from None

    # --- checks before writing ---

    def check(self) -> None:
        """Fail on the first missing tensor or wrong shape, naming it."""
        for pack_name, hf_name in self.dense_names.items():
            self._check_shape(hf_name, expected_dense_shape(pack_name, self.config))
        expert_shapes = expected_expert_shapes(self.config, self.optional)
        for layer in self.config.moe_layer_ids:
            for expert in range(self.config.num_experts):
                names = self.arch.expert_tensor_names(layer, expert)
                for part in expert_part_names(self.optional):
                    self._check_shape(getattr(names, part), expert_shapes[part])
        self._check_tokenizer()
        if self.wrapper:
            log.warning("%s: converting its %s text model (text_config); the vision tower and projector are left out",
                        self.wrapper, self.arch.name)

    def _check_tokenizer(self) -> None:
        """tokenizer.json is copied; a tiktoken.model (Kimi K2) is converted into one, now,
        so a tokenizer that cannot be converted fails before a byte of the pack is written."""
        if (self.src / TOKENIZER_FILE).is_file():
            if self.tokenizer_pattern is not None:
                log.warning("--tokenizer-pattern ignored: the checkpoint has its own %s", TOKENIZER_FILE)
            return
        if not (self.src / TIKTOKEN_FILE).is_file():
            raise ConversionError(f"{self.src / TOKENIZER_FILE} is missing: Colibri needs the fast tokenizer file "
                                  f"({TOKENIZER_FILE}, or a {TIKTOKEN_FILE} it converts)")
        try:
            self.converted_tokenizer_json = convert_tiktoken(self.src, self.tokenizer_pattern)
        except TiktokenError as exc:
            raise ConversionError(f"{self.arch.name} tokenizer: {exc}") from None

    def _check_shape(self, hf_name: str | TensorRef, expected: tuple[int, ...]) -> None:
        if not self.checkpoint.has(hf_name):
            raise ConversionError(f"{self.arch.name} checkpoint {self.src} lacks tensor {hf_name}")
        try:
            shape = self.checkpoint.shape_of(hf_name)
        except CheckpointError as exc:
            raise ConversionError(str(exc)) from None
        if shape != expected:
            raise ConversionError(f"tensor {hf_name} has shape {list(shape)}, expected {list(expected)} from config.json")

    def _source_names(self) -> list[str | TensorRef]:
        """Every checkpoint tensor the pack is made of (a tied head's copy is not)."""
        names = list(self.dense_names.values())
        for layer in self.config.moe_layer_ids:
            for expert in range(self.config.num_experts):
                expert_names = self.arch.expert_tensor_names(layer, expert)
                names.extend(getattr(expert_names, part) for part in expert_part_names(self.optional))
        return names

    # --- encoding ---

    def _encode(self, name: str, loaded: LoadedTensor, wanted: native.TensorType) -> tuple[native.TensorType, tuple[int, ...], np.ndarray]:
        """(type as stored, shape, bytes) of one tensor: vectors stay f32; matrices are decoded
        and quantized by libcolibri on the worker pool (col_convert)."""
        shape = self.checkpoint.shape_of(loaded.request.ref)
        if len(shape) == 1:
            return native.TensorType.F32, shape, np.ascontiguousarray(loaded.data, dtype=np.float32)
        if shape[-1] % wanted.block_elems:
            # A block type cannot represent a row length that is not a whole number of blocks.
            self.report.fallbacks.append(f"{name}: {wanted.name_in_pack} needs rows of a multiple of {wanted.block_elems}, stored as f32")
            wanted = native.TensorType.F32
        matrix = loaded.matrix
        if matrix is None:  # values read_f32 made (MXFP4 re-encoded, more than two axes)
            values = np.ascontiguousarray(loaded.data, dtype=np.float32)
            return wanted, shape, native.quantize(wanted, values.reshape(-1, shape[-1]))
        data = native.convert(wanted, loaded.data, matrix.dtype, rows=matrix.rows, scale_inv=matrix.scale_inv,
                              block=matrix.block, pool=self.pool)
        return wanted, shape, data

    # --- the conversion ---

    def run(self) -> ConversionReport:
        self.check()
        for note in self.arch.conversion_notes(self.hf_config):
            log.warning("%s", note)
        total = self.report.params = sum(self._source_params(name) for name in self._source_names())
        target = self._open_device()  # every rule checked before a byte is written anywhere
        label = f"converting {self.src.name}" + (f" (experts to {target.path})" if target else "")
        progress = Progress(total, label, enabled=self.progress_enabled)
        try:
            with PackWriter(self.out, self.align, self.force, target) as writer:
                with TensorReader(self.checkpoint, self._read_requests()) as reader, WriteBehind() as writes:
                    tensors = iter(reader)
                    self._write_dense(writer, writes, tensors, progress)
                    self._write_experts(writer, writes, tensors, progress)
                self.report.peak_read_bytes = reader.peak_bytes
                tokenizer_files = self._copy_tokenizer(writer)
                manifest = writer.commit(
                    dict(
                        model=self.config,
                        quantization=self.quant.to_json(),
                        tokenizer_files=tokenizer_files,
                        source=self._source_description(),
                        producer=f"colibri-convert {__version__}",
                    )
                )
                if manifest.experts_device is not None:
                    self.report.device = f"{target.path} (pack id {manifest.experts_device.pack_id})"
                self.report.dense_bytes = sum(e.nbytes for e in writer.dense_entries.values())
                self.report.experts_bytes = sum(r.length for r in writer.expert_records)
                self.report.num_expert_records = len(writer.expert_records)
        except FileExistsError as exc:
            raise ConversionError(str(exc)) from None
        except CheckpointError as exc:
            raise ConversionError(str(exc)) from None
        except OSError as exc:
            raise ConversionError(f"writing {self.out}: {exc.strerror or exc}") from None
        finally:
            progress.close()
            if target is not None:
                target.close()
        self.report.seconds = progress.elapsed_s()
        for line in self.report.fallbacks:
            log.warning("%s", line)
        return self.report

    # --- a raw block device for the experts ---

    def planned_experts_bytes(self) -> int:
        """The experts region's size, known before a tensor is read: every record has the same
        parts, in the types the converter stores them in, padded to the alignment."""
        shapes = expected_expert_shapes(self.config, self.optional)
        end = 0
        for part in expert_part_names(self.optional):
            nbytes = tensor_nbytes(expert_part_type(self.quant.experts, shapes[part]), shapes[part])
            end = _round_up(end, EXPERT_PART_ALIGN_BYTES) + nbytes
        records = len(self.config.moe_layer_ids) * self.config.num_experts
        return records * _round_up(end, self.align)

    def _open_device(self) -> WritableDevice | None:
        """The --device, opened exclusively and checked against every safety rule; None without one."""
        if self.device is None:
            return None
        if os.path.lexists(self.out) and not self.force:
            raise ConversionError(f"{self.out} exists; pass --force to replace it")  # before the device is touched
        needed = max(self.align, SUPERBLOCK_BLOCK_BYTES) + self.planned_experts_bytes()
        try:
            target = open_for_writing(self.device, needed, self.device_options)
        except DeviceRefused as exc:
            raise ConversionError(f"--device {exc}") from None
        block = target.device.logical_block_bytes
        if block > self.align or self.align % block:
            target.close()
            raise ConversionError(f"--device {target.path} has {block}-byte logical blocks, more than --align "
                                  f"{self.align}: pass --align {block}")
        for signature in target.overwritten:
            log.warning("%s: overwriting %s", target.path, signature.describe())
        return target

    def _source_params(self, name: str | TensorRef) -> int:
        return int(np.prod(self.checkpoint.shape_of(name), dtype=np.int64))

    def _read_requests(self) -> list[ReadRequest]:
        """Every tensor in the order _write_dense and _write_experts consume them."""
        requests = [ReadRequest(hf_name) for hf_name in self.dense_names.values()]
        for layer in self.config.moe_layer_ids:
            for expert in range(self.config.num_experts):
                names = self.arch.expert_tensor_names(layer, expert)
                for part in expert_part_names(self.optional):
                    hf_name = getattr(names, part)
                    # published MXFP4 kept as mxfp4: the same codes and exponents, only rearranged
                    copy = self.quant.experts is native.TensorType.MXFP4 and self.checkpoint.is_mxfp4(hf_name)
                    requests.append(ReadRequest(hf_name, as_mxfp4=copy))
        return requests

    def _write_dense(self, writer: PackWriter, writes: WriteBehind, tensors: Iterator[LoadedTensor], progress: Progress) -> None:
        for pack_name, hf_name in self.dense_names.items():
            loaded = next(tensors)
            wanted = requested_type(pack_name, len(self.checkpoint.shape_of(hf_name)), self.quant.to_json())
            type_, shape, data = self._encode(pack_name, loaded, wanted)
            if pack_name in self.zero_centred:
                # the model scales by (1 + w) computed in float32: the same float32 factor, once
                data = (data + np.float32(1.0)).astype(np.float32)
            writes.submit(writer.add_dense, pack_name, type_, shape, data)
            progress.advance(self._source_params(hf_name), pack_name)

    def _write_experts(self, writer: PackWriter, writes: WriteBehind, tensors: Iterator[LoadedTensor], progress: Progress) -> None:
        for layer in self.config.moe_layer_ids:
            for expert in range(self.config.num_experts):
                parts = {}
                for part in expert_part_names(self.optional):
                    loaded = next(tensors)
                    hf_name = loaded.request.ref
                    if loaded.request.as_mxfp4:
                        parts[part] = (native.TensorType.MXFP4, self.checkpoint.shape_of(hf_name), loaded.data)
                    else:
                        parts[part] = self._encode(f"layers.{layer}.experts.{expert}.{part}", loaded, self.quant.experts)
                    progress.advance(self._source_params(hf_name), f"layer {layer} expert {expert}")
                writes.submit(writer.add_expert, layer, expert, parts)

    def _copy_tokenizer(self, writer: PackWriter) -> list[str]:
        """The tokenizer files, verbatim (tokenizer_config.json carries the chat template when
        no chat_template.jinja does); a converted tiktoken tokenizer as the tokenizer.json."""
        copied = []
        if self.converted_tokenizer_json is not None:
            writer.add_file_bytes(self.converted_tokenizer_json.encode(), TOKENIZER_FILE)
            copied.append(TOKENIZER_FILE)
        for name in REQUIRED_TOKENIZER_FILES + OPTIONAL_TOKENIZER_FILES:
            if name not in copied and (self.src / name).is_file():
                writer.add_file(self.src / name, name)
                copied.append(name)
        writer.add_file(self.src / "config.json", "source_config.json")
        return copied

    def _source_description(self) -> dict:
        return {
            "model_type": self.hf_config.get("model_type"),
            **({"wrapper_model_type": self.wrapper} if self.wrapper else {}),
            "architectures": self.hf_config.get("architectures"),
            "dtypes": self.checkpoint.source_dtypes,
            **({"tokenizer": f"{TOKENIZER_FILE} converted from {TIKTOKEN_FILE}"} if self.converted_tokenizer_json else {}),
            "path": str(self.src.resolve()),
        }


def convert(src: str | Path, out: str | Path, quant: QuantSpec, align: int = 4096, force: bool = False,
            progress: bool | None = None, tokenizer_pattern: str | None = None,
            pool: native.ThreadPool | None = None, device: str | None = None,
            device_options: WriteOptions | None = None) -> ConversionReport:
    """Convert ``src`` (a Hugging Face checkpoint directory) into a pack at ``out``, quantizing
    on ``pool`` (default: one thread per CPU). ``tokenizer_pattern``: the pre-tokenizer regex of
    a tiktoken tokenizer (or "kimi-k2"), when its class file does not give it as a plain string.
    ``device``: write the experts region to this raw block device instead of experts.bin, if
    it passes the safety rules (colibrid/blockdev/safety.py) as ``device_options`` relax them."""
    return Converter(Path(src), Path(out), quant, align, force, progress, tokenizer_pattern, pool,
                     device, device_options).run()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
