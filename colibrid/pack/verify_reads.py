"""The reading side of a pack verify (pack/verify.py): a SequentialFile reads a file other than
the expert records front to back, O_DIRECT when the file system allows it (the records go
through the libcolibri loader); either is read into one half of a DoubleBuffer while the other
half is being checked, so reading and checking overlap."""

from __future__ import annotations

import mmap
import os
import stat
from concurrent.futures import Future
from pathlib import Path

import numpy as np

DIRECT_ALIGN_BYTES = 4096  # O_DIRECT offsets, lengths and buffers are multiples of this


class DoubleBuffer:
    """Two page-aligned buffers (O_DIRECT needs aligned memory): one is read into while the
    other is checked on the hashing thread. A buffer is reused only once its check is done;
    leaving the block waits for the last checks (and raises what they raised)."""

    def __init__(self, capacity: int) -> None:
        self._maps = [mmap.mmap(-1, capacity) for _ in range(2)]
        self._views = [np.frombuffer(m, dtype=np.uint8) for m in self._maps]
        self._pending: list[Future | None] = [None, None]
        self._turn = 0

    def next_free(self) -> np.ndarray:
        i = self._turn
        self._wait(i)
        self._turn = 1 - i
        return self._views[i]

    def hand_over(self, buffer: np.ndarray, check: Future) -> None:
        self._pending[1 - self._turn] = check  # the buffer next_free just gave out

    def _wait(self, i: int) -> None:
        pending, self._pending[i] = self._pending[i], None
        if pending is not None:
            pending.result()

    def __enter__(self) -> "DoubleBuffer":
        return self

    def __exit__(self, *exc) -> None:
        try:
            for i in range(2):
                self._wait(i)
        finally:
            self._views = []
            for m in self._maps:
                try:
                    m.close()
                except BufferError:  # a view still lives (an exception's traceback): the GC frees it
                    pass


class SequentialFile:
    """A pack file read front to back: opened without following a symbolic link, O_DIRECT
    unless the file system refuses it (then buffered, with a note, and the pages read are
    dropped from the page cache so a verify does not push the experts out of it)."""

    def __init__(self, path: Path, direct: str) -> None:
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        self.note = None
        self.direct = direct != "off"
        self.path = path
        try:
            self.fd = os.open(path, flags | (os.O_DIRECT if self.direct else 0))
        except OSError as exc:
            if not (self.direct and exc.errno == 22):  # EINVAL: no O_DIRECT on this file system
                raise
            if direct == "required":
                raise OSError(exc.errno, f"O_DIRECT refused by the file system of {path.name} (direct = required)")
            self.direct = False
            self.note = f"O_DIRECT refused by the file system of {path.name} (EINVAL): buffered reads"
            self.fd = os.open(path, flags)
        if not stat.S_ISREG(os.fstat(self.fd).st_mode):
            os.close(self.fd)
            raise OSError(21, "not a regular file")

    def read_into(self, buffer: np.ndarray, offset: int, length: int) -> int:
        """Read ``length`` bytes at ``offset`` into buffer; returns the bytes read (fewer only at
        the end of the file). O_DIRECT reads whole blocks: the last one may ask past the end."""
        asked = -(-length // DIRECT_ALIGN_BYTES) * DIRECT_ALIGN_BYTES if self.direct else length
        view, done = memoryview(buffer), 0
        while done < length:
            n = os.preadv(self.fd, [view[done:asked]], offset + done)
            if n == 0:
                break
            done += n
        if not self.direct:
            os.posix_fadvise(self.fd, offset, length, os.POSIX_FADV_DONTNEED)
        return min(done, length)

    def close(self) -> None:
        os.close(self.fd)
