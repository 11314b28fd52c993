"""Write a pack into a temporary directory beside its destination and rename it into
place only when complete, so an interrupted conversion never leaves a loadable pack.

Durability (docs/format.md): every file is fsync'ed, then the manifest is written last
(under a temporary name, fsync'ed, renamed), then the directory is fsync'ed; only then is
the pack renamed into place, and each rename is followed by an fsync of the parent."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import numpy as np

from colibrid import native
from colibrid.blockdev.safety import WritableDevice
from colibrid.pack.device_writer import DeviceExpertsSink
from colibrid.pack.durable import fsync_path, rename_durably
from colibrid.pack.manifest import (
    DENSE_FILE,
    EXPERT_PART_ALIGN_BYTES,
    EXPERTS_FILE,
    ExpertRecord,
    Manifest,
    TensorEntry,
)
from colibrid.pack.recovery import old_dir, partial_dir, recover_interrupted_swap, remove_stale_leftovers

log = logging.getLogger(__name__)


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


class FileExpertsSink:
    """Appends padded expert records to experts.bin; ``finish`` makes them durable."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "wb")
        self.size = 0

    def write(self, record: np.ndarray) -> int:
        offset = self.size  # always aligned: every record is padded
        self._file.write(memoryview(record))
        self.size += record.nbytes
        return offset

    def finish(self) -> None:
        """The records are in the file, durably; there is no device record to give."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def close(self) -> None:
        self._file.close()


class PackWriter:
    """Append dense tensors and expert records; ``commit`` publishes the pack.

    Use as a context manager: leaving the block with an exception deletes the
    temporary directory; ``commit`` must be called explicitly on success.
    """

    def __init__(self, out: Path, alignment: int, force: bool, experts_device: WritableDevice | None = None) -> None:
        if alignment < 4096 or alignment & (alignment - 1):
            raise ValueError(f"--align must be a power of two >= 4096, got {alignment}")
        self.out = out
        self.alignment = alignment
        self.force = force
        self.experts_device = experts_device  # None: the records go to experts.bin in the pack
        self.tmp = partial_dir(out, os.getpid())
        self.dense_entries: dict[str, TensorEntry] = {}
        self.expert_parts: dict[str, TensorEntry] | None = None
        self.expert_records: list[ExpertRecord] = []
        self._dense = None
        self._experts = None

    def __enter__(self) -> "PackWriter":
        recover_interrupted_swap(self.out)  # a pack a killed --force run left beside OUT goes back first
        remove_stale_leftovers(self.out)
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self._dense = open(self.tmp / DENSE_FILE, "wb")
        if self.experts_device is None:
            self._experts = FileExpertsSink(self.tmp / EXPERTS_FILE)
        else:
            self._experts = DeviceExpertsSink(self.experts_device, self.alignment)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._dense is not None and not self._dense.closed:
            self._dense.close()
        if self._experts is not None:
            self._experts.close()
        if self.tmp.exists():
            shutil.rmtree(self.tmp, ignore_errors=True)

    def add_dense(self, name: str, type_: native.TensorType, shape: tuple[int, ...], data: np.ndarray) -> None:
        """Append one tensor's encoded bytes, starting on an alignment boundary."""
        offset = _round_up(self._dense.tell(), self.alignment)
        self._dense.seek(offset)
        self._dense.write(memoryview(np.ascontiguousarray(data)).cast("B"))
        crc = native.crc32c(np.ascontiguousarray(data))
        self.dense_entries[name] = TensorEntry(type_.name_in_pack, tuple(shape), offset, int(data.nbytes), crc)

    def add_expert(self, layer: int, expert: int, parts: dict[str, tuple[native.TensorType, tuple[int, int], np.ndarray]]) -> None:
        """Append one expert record: gate, up, down (then their biases, if any) contiguous, in the
    order of ``parts``, padded to the alignment."""
        layout = self._record_layout(parts)
        length = _round_up(max(e.offset + e.nbytes for e in layout.values()), self.alignment)
        record = np.zeros(length, dtype=np.uint8)
        for name in parts:
            entry, data = layout[name], parts[name][2]
            record[entry.offset : entry.offset + entry.nbytes] = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        offset = self._experts.write(record)
        crc = native.crc32c(record)
        self.expert_records.append(ExpertRecord(layer, expert, offset, length, crc))

    def _record_layout(self, parts) -> dict[str, TensorEntry]:
        layout, cursor = {}, 0
        for name in parts:  # EXPERT_PARTS, then EXPERT_BIAS_PARTS if the model has expert biases
            type_, shape, data = parts[name]
            layout[name] = TensorEntry(type_.name_in_pack, tuple(shape), cursor, int(data.nbytes))
            cursor = _round_up(cursor + int(data.nbytes), EXPERT_PART_ALIGN_BYTES)
        if self.expert_parts is None:
            self.expert_parts = layout
        elif layout != self.expert_parts:
            raise ValueError(f"expert record layout differs between experts: {layout} vs {self.expert_parts}")
        return layout

    def add_file(self, src: Path, name: str) -> None:
        shutil.copyfile(src, self.tmp / name)
        fsync_path(self.tmp / name)

    def add_file_bytes(self, data: bytes, name: str) -> None:
        """A file made by the converter (a tokenizer.json converted from tiktoken.model)."""
        (self.tmp / name).write_bytes(data)
        fsync_path(self.tmp / name)

    def commit(self, manifest_fields: dict) -> Manifest:
        """Flush everything, write the manifest last and rename the pack into place."""
        self._dense.flush()
        os.fsync(self._dense.fileno())
        dense_size = self._dense.tell()
        self._dense.close()
        device_record = self._experts.finish()  # on a device: the superblock, last
        manifest = Manifest(
            alignment=self.alignment,
            dense_tensors=self.dense_entries,
            dense_size=dense_size,
            expert_parts=self.expert_parts or {},
            expert_records=self.expert_records,
            experts_size=self._experts.size,
            experts_device=device_record,
            **manifest_fields,
        )
        manifest.write(self.tmp)  # last, and durably: its presence marks the pack complete
        fsync_path(self.tmp)
        self._publish()
        return manifest

    def _publish(self) -> None:
        """Rename the finished pack into place. Replacing one takes two renames; a run killed
        between them is repaired by recover_interrupted_swap (next run, or Pack.open)."""
        old = None
        if os.path.lexists(self.out):
            if not self.force:
                raise FileExistsError(f"{self.out} exists; pass --force to replace it")
            old = old_dir(self.out, os.getpid())
            rename_durably(self.out, old)
        rename_durably(self.tmp, self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
