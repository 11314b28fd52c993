"""Check a whole pack: the manifest (parsed strictly, validated against its model, its own
SHA-256), the CRC-32C of every dense tensor and of every expert record, and the SHA-256 of
every file (and of the experts region of a pack on a raw block device), reading each byte
once. ``colibri-verify PACK`` (colibrid/tools/verify_cli.py) and the daemon's `verify` request
(colibrid/daemon/verify_request.py) both run a PackVerifier.

How it reads:
  the records   through the pack's ExpertsRegion (experts.bin, or the device found by its
                superblock) and its libcolibri loader, the reader the engine loads experts
                with: whole records, O_DIRECT, at most ``queue_depth`` in flight, each
                record's CRC-32C checked in C by the I/O thread that read it;
  the others    (dense.bin, the tokenizer files) front to back in CHUNK_BYTES reads, O_DIRECT
                when the file system allows it (buffered otherwise, said in the notes).
Reads happen on the calling thread (and the loader's I/O threads, which it starts): the daemon
lowers that thread's I/O priority first. The bytes read are hashed (SHA-256, hashlib, which
releases the GIL) and the dense tensors' CRC-32C computed on a second thread while the next
batch is read. Two buffers of at most BATCH_BYTES are all the memory it takes.

Nothing in the pack is trusted: the manifest is checked completely before any offset in it is
used, every file is opened without following a symbolic link and must be a regular file of the
size the manifest says. What is wrong is reported, never raised: a Damage per finding, naming
the file and where in it (layer, expert and offset of an expert record; name and offset of a
dense tensor), and the run goes on to find the rest.

What a verify reports, and the controls its caller steers it with, are verify_report.py's; the
sequential reads and the double buffer, verify_reads.py's.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from colibrid import native
from colibrid.pack.experts_region import ExpertsRegion, experts_region
from colibrid.pack.manifest import (
    DENSE_FILE, EXPERTS_FILE, MANIFEST_FILE, ExpertRecord, Manifest, PackError, TensorEntry, manifest_content_sha256,
    read_manifest_data,
)
from colibrid.pack.validate import check_manifest
from colibrid.pack.verify_reads import DIRECT_ALIGN_BYTES, DoubleBuffer, SequentialFile
from colibrid.pack.verify_report import Damage, Progress, VerifyCancelled, VerifyControls, VerifyReport

log = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20  # one sequential read of a file other than experts.bin
# What findings and the report's files call the experts region of a pack on a raw block device
# (the manifest key that describes it; its digest is experts.device.sha256).
EXPERTS_DEVICE = "experts.device"
BATCH_BYTES = 32 << 20  # expert records read per loader call (at least one record)
PACING_WINDOW_S = 0.25  # under a bandwidth cap, one read is at most this many seconds' worth
DIRECT_MODES = {"try": native.AepcMode.TRY, "required": native.AepcMode.REQUIRED, "off": native.AepcMode.OFF}


@dataclass
class _FileCheck:
    """One file to read: its name, its size, the SHA-256 the manifest records (or None) and,
    for dense.bin, the tensors whose CRC-32C to check (sorted by offset)."""

    name: str
    size: int
    sha256: str | None
    tensors: list[tuple[str, TensorEntry]] = field(default_factory=list)
    records: list[ExpertRecord] | None = None  # the experts: read through the loader, record by record
    region: ExpertsRegion | None = None  # where the records are (experts.bin or a device), with records
    unreadable: bool = False  # a read failed: its SHA-256 cannot be computed
    damaged_parts: int = 0


class PackVerifier:
    """Verifies the pack at ``path`` once: ``run()`` returns the report."""

    def __init__(self, path: str | Path, queue_depth: int = 16, direct: str = "try",
                 controls: VerifyControls | None = None, batch_bytes: int = BATCH_BYTES) -> None:
        if direct not in DIRECT_MODES:
            raise ValueError(f"direct must be one of {', '.join(DIRECT_MODES)}, got {direct!r}")
        if not 1 <= queue_depth <= 1024:
            raise ValueError(f"queue_depth must be in 1..1024, got {queue_depth}")
        self.path = Path(path)
        self.queue_depth = queue_depth
        self.direct = direct
        self.controls = controls or VerifyControls()
        self.batch_bytes = batch_bytes
        self.report = VerifyReport(str(self.path))
        self._lock = threading.Lock()  # the report and the progress, shared by the two threads
        self._started_s = 0.0
        self._bytes_total = 0
        self._bytes_submitted = 0  # for the bandwidth cap
        self._last_progress_s = float("-inf")
        self._file = ""

    # ---- the run --------------------------------------------------------------------------

    def run(self) -> VerifyReport:
        self._started_s = time.monotonic()
        try:
            manifest = self._check_manifest()
            if manifest is not None:
                checks = self._files_to_read(manifest)
                self._bytes_total = sum(check.size for check in checks)
                self._progress(force=True)  # what there is to read, before the first read
                with ThreadPoolExecutor(max_workers=1, thread_name_prefix="colibri-verify-hash") as hasher:
                    for check in checks:
                        self._file = check.name
                        if check.records is not None:
                            self._read_experts(check, manifest, hasher)
                        else:
                            self._read_file(check, hasher)
        except VerifyCancelled:
            self.report.cancelled = True
        self.report.seconds = time.monotonic() - self._started_s
        self._progress(force=True)
        return self.report

    def _check_manifest(self) -> Manifest | None:
        """The manifest if it can be used to read the rest; else None (the damage says why)."""
        manifest_path = self.path / MANIFEST_FILE
        if not self.path.is_dir():
            self._damage(Damage(MANIFEST_FILE, f"{self.path} does not exist or is not a directory"))
            return None
        try:
            data = read_manifest_data(self.path)
            manifest = Manifest.from_data(data, manifest_path)
        except PackError as exc:
            self._damage(Damage(MANIFEST_FILE, str(exc)))
            return None
        if manifest.manifest_sha256 is None:
            self._note(f"{MANIFEST_FILE} records no SHA-256 of itself (a pack converted before they were "
                       "recorded): only its consistency is checked; re-convert it to record them")
            self.report.files[MANIFEST_FILE] = "sha256 not recorded"
        else:
            digest = manifest_content_sha256(data)
            if digest != manifest.manifest_sha256:
                self._damage(Damage(MANIFEST_FILE, f"{MANIFEST_FILE}: its content differs from what was written "
                                                   f"(SHA-256 {digest}, recorded {manifest.manifest_sha256})"))
            self.report.files[MANIFEST_FILE] = "ok" if digest == manifest.manifest_sha256 else "damaged"
        try:
            check_manifest(manifest)
        except ValueError as exc:
            self._damage(Damage(MANIFEST_FILE, f"{MANIFEST_FILE} is inconsistent: {exc}"))
            self.report.files[MANIFEST_FILE] = "damaged"
            # Its offsets cannot be trusted: only the files' digests are checked.
            manifest.dense_tensors, manifest.expert_records = {}, []
            manifest.dense_size = manifest.experts_size = -1
        if not manifest.has_dense_checksums:
            self._note(f"pack format version {manifest.format_version} has no dense checksums: {DENSE_FILE}'s "
                       "tensors are checked by its SHA-256 only, if recorded")
        return manifest

    def _files_to_read(self, manifest: Manifest) -> list[_FileCheck]:
        """The files to read, in the order they are read: each one the pack needs or the
        manifest records a digest of, that exists as a regular file of the expected size;
        on a device pack, its experts region second, in place of experts.bin."""
        recorded = manifest.file_sha256
        if not recorded:
            self._note("the manifest records no SHA-256 of the pack's files (a pack converted before they were "
                       "recorded): the files are checked by their CRC-32C only; re-convert it to record them")
        on_device = manifest.experts_device is not None
        sizes = {DENSE_FILE: manifest.dense_size, EXPERTS_FILE: manifest.experts_size}
        names = list(dict.fromkeys([DENSE_FILE, *([] if on_device else [EXPERTS_FILE]), *manifest.tokenizer_files,
                                    *recorded]))
        checks = []
        for name in names:
            size = self._regular_file_size(name)
            if size is None:
                continue
            expected = sizes.get(name, -1)
            if expected >= 0 and size != expected:
                self._damage(Damage(name, f"{name} has {size} bytes, the manifest says {expected}"))
                self.report.files[name] = "damaged"
                continue
            check = _FileCheck(name, size, recorded.get(name))
            if name == DENSE_FILE and expected >= 0:
                check.tensors = sorted(((n, e) for n, e in manifest.dense_tensors.items() if e.crc32c is not None),
                                       key=lambda item: item[1].offset)
            if name == EXPERTS_FILE and expected >= 0 and manifest.expert_records and not on_device:
                check.records, check.region = manifest.expert_records, experts_region(self.path, manifest)
            if check.sha256 is None and not check.tensors and check.records is None:
                self.report.files[name] = "sha256 not recorded"  # nothing to check it against
                continue
            if check.sha256 is None:
                self.report.files[name] = "sha256 not recorded"
            checks.append(check)
        region = self._device_check(manifest) if on_device else None
        if region is not None:  # read where experts.bin would be: after dense.bin
            checks.insert(1 if checks and checks[0].name == DENSE_FILE else 0, region)
        return checks

    def _device_check(self, manifest: Manifest) -> _FileCheck | None:
        """The experts region of a pack on a raw block device, found by its superblock as the
        daemon finds it; None (and a Damage) when it cannot be found or trusted."""
        name, digest = EXPERTS_DEVICE, manifest.experts_device.sha256
        if manifest.experts_size < 0 or not manifest.expert_records:  # an inconsistent manifest: no usable index
            self.report.files[name] = "damaged"
            return None
        region = experts_region(self.path, manifest)
        try:
            region.check()  # the device carrying the pack id, its superblock matching the manifest
        except PackError as exc:
            self._damage(Damage(name, str(exc)))
            self.report.files[name] = "missing"
            return None
        if digest is None:
            self._note(f"the manifest records no SHA-256 of the experts region ({name}.sha256): its records are "
                       "checked by their CRC-32C only; re-convert the pack to record it")
            self.report.files[name] = "sha256 not recorded"
        return _FileCheck(name, manifest.experts_size, digest, records=manifest.expert_records, region=region)

    def _regular_file_size(self, name: str) -> int | None:
        """The size of the pack's file ``name``; None (and a Damage) if it is missing or not a
        regular file - a symbolic link is not followed."""
        try:
            info = os.lstat(self.path / name)
        except FileNotFoundError:
            self._damage(Damage(name, f"{name} is missing"))
            self.report.files[name] = "missing"
            return None
        except OSError as exc:
            self._damage(Damage(name, f"{name}: {exc.strerror}"))
            self.report.files[name] = "damaged"
            return None
        if not stat.S_ISREG(info.st_mode):
            self._damage(Damage(name, f"{name} is not a regular file"))
            self.report.files[name] = "damaged"
            return None
        return info.st_size

    # ---- the expert records, through the loader ---------------------------------------------

    def _read_experts(self, check: _FileCheck, manifest: Manifest, hasher: ThreadPoolExecutor) -> None:
        """Every record in index order, in batches of whole records, through the loader of the
        pack's ExpertsRegion (experts.bin, or the device). The records follow each other without
        gaps, so their bytes in order are the whole of experts.bin, or of the device's region."""
        region = check.region
        record_bytes = max(r.length for r in check.records)
        capacity = max(record_bytes, self._batch_limit())
        try:
            loader = region.loader(self.queue_depth, self.queue_depth, DIRECT_MODES[self.direct])
        except (native.ColibriError, PackError, OSError) as exc:
            self._damage(Damage(check.name, f"{check.name} cannot be opened: {exc}"))
            self.report.files[check.name] = "damaged"
            return
        try:
            sha256 = hashlib.sha256()
            with DoubleBuffer(capacity) as buffers:
                for batch in _batches(check.records, capacity):
                    buffer = buffers.next_free()
                    self._before_read(sum(r.length for r in batch))
                    start = batch[0].offset
                    status, results = loader.read([(buffer[r.offset - start:], region.device_offset(r), r.length,
                                                    r.crc32c) for r in batch])
                    length = batch[-1].offset + batch[-1].length - start
                    buffers.hand_over(buffer, hasher.submit(self._check_records, check, sha256, batch, results,
                                                            buffer[:length]))
            if self.direct != "off" and not loader.info()["direct"]:
                self._note(f"O_DIRECT refused for {check.name} ({region.describe()}) (EINVAL): buffered reads")
            self._finish_file(check, sha256)
        finally:
            loader.close()

    def _check_records(self, check: _FileCheck, sha256, batch: list[ExpertRecord], results: list[dict],
                       data: np.ndarray) -> None:
        """On the hashing thread: the loader's verdict on each record, and the batch's bytes
        into the file's SHA-256."""
        for record, result in zip(batch, results):
            ok = result["status"] == native.Status.OK
            if not ok:
                check.damaged_parts += 1
                where = f"expert {record.expert} of layer {record.layer} ({_record_place(check, record)})"
                if result["status"] == native.Status.ECHECKSUM:
                    message = (f"{where} does not match its checksum: crc32c {result['crc32c']:#010x} read, "
                               f"{record.crc32c:#010x} in the manifest")
                else:
                    check.unreadable = True
                    errno_ = result["sys_errno"]
                    message = f"{where} cannot be read: " + (os.strerror(errno_) if errno_ else "short read")
                self._damage(Damage(check.name, message, record.offset, record.length, record.layer, record.expert))
            if self.controls.on_expert is not None:
                wrong_crc = result["crc32c"] if result["status"] == native.Status.ECHECKSUM else None
                self.controls.on_expert(record, ok, wrong_crc)
        sha256.update(data)
        self._advance(data.nbytes)

    # ---- the other files, front to back ---------------------------------------------------

    def _read_file(self, check: _FileCheck, hasher: ThreadPoolExecutor) -> None:
        chunk_bytes = min(CHUNK_BYTES, self._batch_limit())
        chunk_bytes = max(DIRECT_ALIGN_BYTES, chunk_bytes - chunk_bytes % DIRECT_ALIGN_BYTES)
        try:
            reader = SequentialFile(self.path / check.name, self.direct)
        except OSError as exc:
            self._damage(Damage(check.name, f"{check.name} cannot be opened: {exc.strerror}"))
            self.report.files[check.name] = "damaged"
            return
        if reader.note:
            self._note(reader.note)
        sha256 = hashlib.sha256()
        crcs = _TensorChecksums(check.tensors)
        try:
            with DoubleBuffer(chunk_bytes) as buffers:
                for offset in range(0, check.size, chunk_bytes):
                    buffer = buffers.next_free()
                    length = min(chunk_bytes, check.size - offset)
                    self._before_read(length)
                    try:
                        got = reader.read_into(buffer, offset, length)
                    except OSError as exc:
                        self._damage(Damage(check.name, f"{check.name} cannot be read at byte {offset}: "
                                                        f"{exc.strerror}", offset, length))
                        check.unreadable = True
                        break
                    if got < length:
                        self._damage(Damage(check.name, f"{check.name} ended at byte {offset + got} while "
                                                        f"being read ({check.size} bytes when it was opened)"))
                        check.unreadable = True
                        break
                    buffers.hand_over(buffer, hasher.submit(self._check_chunk, check, sha256, crcs, offset,
                                                            buffer[:length]))
        finally:
            reader.close()
        self._finish_file(check, sha256)

    def _check_chunk(self, check: _FileCheck, sha256, crcs: "_TensorChecksums", offset: int, data: np.ndarray) -> None:
        sha256.update(data)
        for name, entry, crc in crcs.update(offset, data):
            check.damaged_parts += 1
            self._damage(Damage(check.name, f"dense tensor {name!r} ({check.name} bytes {entry.offset}.."
                                            f"{entry.offset + entry.nbytes}) does not match its checksum: crc32c "
                                            f"{crc:#010x} read, {entry.crc32c:#010x} in the manifest",
                                offset=entry.offset, length=entry.nbytes, tensor=name))
        self._advance(data.nbytes)

    def _finish_file(self, check: _FileCheck, sha256) -> None:
        """Called once the hashing thread has seen every byte (the double buffer waits for it)."""
        if self.report.cancelled or self.controls.stop.is_set():
            return
        if check.unreadable:
            self.report.files[check.name] = "damaged"
            return
        if check.sha256 is None:
            self.report.files[check.name] = ("damaged" if check.damaged_parts else "sha256 not recorded")
            return
        digest = sha256.hexdigest()
        if digest == check.sha256:
            self.report.files[check.name] = "damaged" if check.damaged_parts else "ok"
            return
        self.report.files[check.name] = "damaged"
        where = ("see the damaged parts above" if check.damaged_parts else
                 "every checksummed part matches: the difference is elsewhere in the file, e.g. in padding"
                 if check.tensors or check.records else "it has no checksummed parts")
        self._damage(Damage(check.name, f"{check.name}: SHA-256 {digest} read, {check.sha256} in the manifest "
                                        f"({where})"))

    # ---- pacing, progress and findings ------------------------------------------------------

    def _batch_limit(self) -> int:
        """Bytes per read: BATCH_BYTES, or less under a bandwidth cap, so a capped verify reads
        in small steps rather than bursts."""
        cap = self.controls.max_bytes_per_s
        if not cap:
            return self.batch_bytes
        return max(DIRECT_ALIGN_BYTES, min(self.batch_bytes, int(cap * PACING_WINDOW_S)))

    def _before_read(self, nbytes: int) -> None:
        """Before each read: stop if asked, wait while the caller says so, and keep under the cap."""
        controls = self.controls
        if controls.stop.is_set():
            raise VerifyCancelled()
        if controls.before_read is not None:
            controls.before_read()
        cap = controls.max_bytes_per_s
        if cap:
            wait_s = self._started_s + self._bytes_submitted / cap - time.monotonic()
            if wait_s > 0 and controls.stop.wait(wait_s):
                raise VerifyCancelled()
        if controls.stop.is_set():
            raise VerifyCancelled()
        self._bytes_submitted += nbytes

    def _advance(self, nbytes: int) -> None:
        with self._lock:
            self.report.bytes_read += nbytes
        self._progress()

    def _progress(self, force: bool = False) -> None:
        if self.controls.on_progress is None:
            return
        now = time.monotonic()
        with self._lock:
            if not force and now - self._last_progress_s < self.controls.progress_interval_s:
                return
            self._last_progress_s = now
            progress = Progress(self.report.bytes_read, self._bytes_total, now - self._started_s, self._file)
        self.controls.on_progress(progress)

    def _damage(self, damage: Damage) -> None:
        with self._lock:
            self.report.damage.append(damage)
        log.debug("%s: %s", self.path, damage.message)
        if self.controls.on_damage is not None:
            self.controls.on_damage(damage)

    def _note(self, note: str) -> None:
        with self._lock:
            if note not in self.report.notes:
                self.report.notes.append(note)


def verify_pack(path: str | Path, **kwargs) -> VerifyReport:
    """Verify the pack at ``path`` (PackVerifier's arguments) and return the report."""
    return PackVerifier(path, **kwargs).run()


# ---- helpers ------------------------------------------------------------------------------


def _record_place(check: _FileCheck, record: ExpertRecord) -> str:
    """Where a record is, for a finding: its bytes in experts.bin, or in the device's experts
    region and the LBA they start at."""
    span = f"bytes {record.offset}..{record.offset + record.length}"
    if check.region is None or not check.region.on_device:
        return f"{check.name} {span}"
    return f"experts region {span}, {check.region.where(record.offset)}"


def _batches(records: list[ExpertRecord], capacity: int) -> Iterator[list[ExpertRecord]]:
    """Consecutive records in runs of at most ``capacity`` bytes (at least one record each)."""
    batch, size = [], 0
    for record in records:
        if batch and size + record.length > capacity:
            yield batch
            batch, size = [], 0
        batch.append(record)
        size += record.length
    if batch:
        yield batch


class _TensorChecksums:
    """The CRC-32C of each dense tensor, computed chunk by chunk as the file streams past
    (a tensor may span several chunks: CRC-32C continues across calls)."""

    def __init__(self, tensors: list[tuple[str, TensorEntry]]) -> None:
        self._tensors = tensors  # sorted by offset, not overlapping (check_manifest)
        self._next = 0  # the first tensor not finished
        self._crc = 0  # of its bytes so far

    def update(self, offset: int, data: np.ndarray) -> list[tuple[str, TensorEntry, int]]:
        """Feed the chunk at ``offset``; returns (name, entry, crc) of each tensor that ended in
        it with the wrong checksum."""
        wrong, end = [], offset + data.nbytes
        while self._next < len(self._tensors):
            name, entry = self._tensors[self._next]
            start, stop = max(entry.offset, offset), min(entry.offset + entry.nbytes, end)
            if start < stop:
                self._crc = native.crc32c(data[start - offset : stop - offset], self._crc)
            if entry.offset + entry.nbytes > end:
                break  # continues in the next chunk
            if self._crc != entry.crc32c:
                wrong.append((name, entry, self._crc))
            self._next, self._crc = self._next + 1, 0
        return wrong

