"""Reading checkpoint tensors ahead of the quantizer, on a thread of its own.

The converter asks for its tensors in order; a reader thread reads the next ones while the
worker pool quantizes the current one and the main thread writes it, so the disk and the
cores work at the same time. Memory stays bounded: the tensor being encoded, ``depth`` read
tensors waiting in the queue and one more read by the thread and waiting for room in it, at
most depth + 2 tensors' source bytes. Their peak (``peak_bytes``) goes into the conversion
report.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from colibrid.tools.convert.safetensors import Checkpoint, SourceMatrix, TensorRef

DEFAULT_DEPTH = 1  # tensors read ahead: one is enough to hide a read behind a quantization


@dataclass(frozen=True)
class ReadRequest:
    ref: str | TensorRef
    as_mxfp4: bool = False  # the published MXFP4 bytes, rearranged (copied, not decoded)


@dataclass
class LoadedTensor:
    """One tensor as read: ``raw`` (N, C) source elements to decode in libcolibri when
    ``matrix`` is set; otherwise ``values`` (float32, read_f32) or, for as_mxfp4, the pack's
    mxfp4 rows."""

    request: ReadRequest
    matrix: SourceMatrix | None
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def load(checkpoint: Checkpoint, request: ReadRequest) -> LoadedTensor:
    if request.as_mxfp4:
        return LoadedTensor(request, None, checkpoint.read_mxfp4(request.ref))
    matrix = checkpoint.source_matrix(request.ref)
    if matrix is None:
        return LoadedTensor(request, None, checkpoint.read_f32(request.ref))
    return LoadedTensor(request, matrix, checkpoint.read_source(matrix))


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_DONE = object()


class TensorReader:
    """Iterate to get ``requests`` loaded, in order; reading runs ``depth`` tensors ahead.
    An error while reading is raised where its tensor would have been yielded. Use as a
    context manager: leaving early stops the thread."""

    def __init__(self, checkpoint: Checkpoint, requests: Sequence[ReadRequest], depth: int = DEFAULT_DEPTH) -> None:
        self.checkpoint = checkpoint
        self.requests = list(requests)
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._held_bytes = 0  # read and not yet released by the consumer
        self.peak_bytes = 0
        self._thread = threading.Thread(target=self._run, name="colibri-convert-reader", daemon=True)

    def __enter__(self) -> "TensorReader":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        while self._thread.is_alive():  # unblock a put() on a full queue
            try:
                self._queue.get(timeout=0.05)
            except queue.Empty:
                pass
        self._thread.join()

    def _hold(self, nbytes: int) -> None:
        with self._lock:
            self._held_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self._held_bytes)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for request in self.requests:
                if self._stop.is_set():
                    return
                loaded = load(self.checkpoint, request)
                self._hold(loaded.nbytes)
                if not self._put(loaded):
                    return
        except BaseException as exc:  # handed to the consumer, raised there
            self._put(_Failed(exc))
            return
        self._put(_DONE)

    def __iter__(self) -> Iterator[LoadedTensor]:
        previous = 0
        while True:
            item = self._queue.get()
            with self._lock:  # the consumer is done with the previous tensor
                self._held_bytes -= previous
            if item is _DONE:
                return
            if isinstance(item, _Failed):
                raise item.exc
            previous = item.nbytes
            yield item
