"""Writes that survive a crash or a power cut: fsync the data, then the directory entry.

A rename or a new file is durable only once its directory has been fsync'ed too; a file
written in place can be seen half-written after a crash, so whole files are written under
a temporary name and renamed over the old one.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by name (a directory's fsync makes its entries durable)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomically(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that after a crash it holds either the old or the new
    contents, never a mix: write a sibling, fsync it, rename it over, fsync the directory."""
    partial = path.with_name(f".{path.name}.partial-{os.getpid()}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)  # a failed write leaves the old file, and nothing else
        raise
    fsync_path(path.parent)


def rename_durably(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst`` (same directory) and make the new name survive a crash."""
    os.rename(src, dst)
    fsync_path(dst.parent)
