"""Open a pack: validate the manifest against the model and the files, read the dense
file into memory and check its tensors' checksums, and describe where each routed
expert's record lives."""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from colibrid import native
from colibrid.native import TensorType
from colibrid.pack.damage import DamageMarks
from colibrid.pack.experts_region import ExpertsRegion, experts_region
from colibrid.pack.manifest import DENSE_FILE, ExpertRecord, Manifest, PackError
from colibrid.pack.recovery import recover_interrupted_swap
from colibrid.pack.tensor import PackedTensor
from colibrid.pack.validate import check_manifest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExpertWeights:
    """One routed expert, viewed inside its record's bytes."""

    gate: PackedTensor  # (F, D)
    up: PackedTensor  # (F, D)
    down: PackedTensor  # (D, F)
    gate_bias: PackedTensor | None = None  # (F) f32, with ModelConfig.expert_bias
    up_bias: PackedTensor | None = None  # (F)
    down_bias: PackedTensor | None = None  # (D)

    @cached_property
    def kernel_buffers(self) -> native.ExpertBuffers | None:
        """The three matrices as libcolibri's fused expert call takes them, checked once per
        view (views of resident records and of cache slots live long); None when the parts
        are not all of one type (the converter never writes that)."""
        if not self.gate.type == self.up.type == self.down.type:
            return None
        ffn, dim = self.gate.shape
        biases = None if self.gate_bias is None else (self.gate_bias.data, self.up_bias.data, self.down_bias.data)
        return native.ExpertBuffers(self.gate.type, self.gate.data, self.up.data, self.down.data, dim, ffn, biases)


# dense.bin is read in chunks of this size, each dropped from the page cache once copied: the
# dense weights are then resident once (in anonymous memory), not twice.
DENSE_READ_CHUNK_BYTES = 64 << 20


class Pack:
    """A validated, opened pack. Dense tensors are read-only views of one anonymous buffer
    holding all of dense.bin: read at open, checked, and out of reach of any later change to
    the file (a mapped file truncated under a running daemon would kill it with SIGBUS)."""

    def __init__(self, path: Path, manifest: Manifest, dense: np.ndarray, experts: ExpertsRegion | None = None) -> None:
        self.path = path
        self.manifest = manifest
        self.experts = experts or experts_region(path, manifest)  # where the expert records are read from
        self._dense = dense  # uint8 (dense_size,), read-only, in anonymous memory
        self.notes: list[str] = []  # what is weaker than it should be about this pack (status shows it)
        self.damage = DamageMarks()  # expert records found damaged while it is open
        config = manifest.model
        self._records = np.full((config.num_layers, max(config.num_experts, 1)), -1, dtype=np.int64)
        for i, record in enumerate(manifest.expert_records):
            self._records[record.layer, record.expert] = i

    @property
    def dense_buffer(self) -> np.ndarray:
        """All of dense.bin as one read-only uint8 buffer (what status measures as resident)."""
        return self._dense

    @classmethod
    def open(cls, path: str | Path) -> "Pack":
        path = Path(path)
        recover_interrupted_swap(path)  # a conversion killed while replacing this pack
        if not path.is_dir():
            raise PackError(f"pack {path} does not exist or is not a directory")
        manifest = Manifest.read(path)
        try:
            check_manifest(manifest)
        except ValueError as exc:
            raise PackError(f"pack {path} is damaged: {exc}") from None
        dense = path / DENSE_FILE
        if not dense.is_file():
            raise PackError(f"pack {path} is incomplete: {DENSE_FILE} is missing")
        if dense.stat().st_size != manifest.dense_size:
            raise PackError(f"pack {path} is damaged: {DENSE_FILE} has {dense.stat().st_size} bytes, "
                            f"manifest says {manifest.dense_size}")
        experts = experts_region(path, manifest)
        experts.check()  # experts.bin, or the device carrying the pack id, found by its superblock
        if manifest.dense_size == 0:
            raise PackError(f"pack {path} has an empty dense file")
        pack = cls(path, manifest, read_dense(dense, manifest.dense_size), experts)
        pack._check_dense_checksums()
        return pack

    @property
    def experts_path(self) -> Path:
        """The experts file, or the device node the experts region was last found at."""
        return self.experts.path

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
        for name, entry in self.manifest.expert_parts.items():  # validated: expert_part_names(model)
            raw = record_bytes[entry.offset : entry.offset + entry.nbytes]
            parts[name] = PackedTensor.from_bytes(TensorType.from_name(entry.type), entry.shape, raw)
        return ExpertWeights(**parts)

    def _check_dense_checksums(self) -> None:
        """Every dense tensor against its CRC-32C, so damage shows at start, not mid-conversation."""
        if not self.manifest.has_dense_checksums:
            note = (f"pack format version {self.manifest.format_version} has no dense checksums: damage to "
                    f"{DENSE_FILE} goes undetected; re-convert it (colibri-convert --force) to add them")
            log.warning("%s: %s", self.path, note)
            self.notes.append(note)
            return
        for name, entry in self.manifest.dense_tensors.items():
            crc = native.crc32c(self._dense[entry.offset : entry.offset + entry.nbytes])
            if crc != entry.crc32c:
                raise PackError(
                    f"pack {self.path} is damaged: dense tensor {name!r} ({DENSE_FILE} bytes "
                    f"{entry.offset}..{entry.offset + entry.nbytes}) has crc32c {crc:#010x}, the manifest "
                    f"says {entry.crc32c:#010x}; re-convert the checkpoint"
                )


def read_dense(file: Path, size_bytes: int) -> np.ndarray:
    """All of ``file`` (exactly ``size_bytes``) in a new read-only uint8 buffer of anonymous
    memory. The file is opened without following a symbolic link and must be a regular file;
    if it shrinks while being read, that is an error, not a short buffer."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise PackError(f"cannot open {file}: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise PackError(f"{file} is not a regular file")
        buffer = np.empty(size_bytes, dtype=np.uint8)
        view = memoryview(buffer)
        for start in range(0, size_bytes, DENSE_READ_CHUNK_BYTES):
            end = min(start + DENSE_READ_CHUNK_BYTES, size_bytes)
            _read_exactly(fd, view, start, end, file, size_bytes)
            # The copy is what the engine uses: the cached pages of the file would count twice.
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
        buffer.flags.writeable = False
        return buffer
    except OSError as exc:
        raise PackError(f"reading {file}: {exc.strerror}") from None
    finally:
        os.close(fd)


def _read_exactly(fd: int, view: memoryview, start: int, end: int, file: Path, size_bytes: int) -> None:
    """Fill view[start:end] from the same offsets of ``fd`` (a read may return less)."""
    while start < end:
        n = os.preadv(fd, [view[start:end]], start)
        if n == 0:
            raise PackError(f"{file} shrank to {start} bytes while being read (the manifest says {size_bytes})")
        start += n
