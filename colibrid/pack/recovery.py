"""Put a pack back in place after a conversion was killed while replacing it.

``colibri-convert --force`` publishes a pack with two renames: the existing pack OUT to
``.OUT.old-PID``, then the finished ``.OUT.partial-PID`` to OUT. Killed between the two,
it leaves nothing at OUT. The next conversion and the daemon's start (Pack.open) finish
the swap when the new pack is complete (its manifest.json exists: the writer creates it
last, under a temporary name, after fsync'ing every other file), else put the old one
back.

Only directories named after OUT with this pattern, whose PID is no longer running, are
touched, and never through a symbolic link.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
from pathlib import Path

from colibrid.pack.durable import rename_durably
from colibrid.pack.manifest import MANIFEST_FILE

log = logging.getLogger(__name__)

PARTIAL_MARK = ".partial-"  # a pack being written: .{OUT}.partial-{pid}
OLD_MARK = ".old-"  # the pack being replaced, between the two renames: .{OUT}.old-{pid}


def partial_dir(out: Path, pid: int) -> Path:
    return out.parent / f".{out.name}{PARTIAL_MARK}{pid}"


def old_dir(out: Path, pid: int) -> Path:
    return out.parent / f".{out.name}{OLD_MARK}{pid}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def is_real_dir(path: Path) -> bool:
    """A directory itself, not a symbolic link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def is_complete(pack_dir: Path) -> bool:
    """A pack directory the writer finished: its manifest, written last, is there."""
    try:
        return stat.S_ISREG(os.lstat(pack_dir / MANIFEST_FILE).st_mode)
    except OSError:
        return False


def leftovers(out: Path, mark: str) -> list[tuple[int, Path]]:
    """(pid, path) of the directories ``.{OUT}{mark}{pid}`` of conversions no longer running."""
    pattern = re.compile(re.escape(f".{out.name}{mark}") + r"([0-9]{1,10})")
    found = []
    try:
        names = os.listdir(out.parent)
    except OSError:
        return []
    for name in names:
        match = pattern.fullmatch(name)
        if match and is_real_dir(out.parent / name) and not pid_alive(int(match.group(1))):
            found.append((int(match.group(1)), out.parent / name))
    return sorted(found)


def recover_interrupted_swap(out: Path) -> None:
    """If OUT is missing and a killed ``--force`` conversion left its old pack beside it, finish
    the swap (the new pack is complete) or put the old pack back. Failures are logged, not
    raised: the caller then finds OUT missing and says so."""
    if os.path.lexists(out):
        return
    for pid, old in leftovers(out, OLD_MARK):
        new = partial_dir(out, pid)
        chosen, what = (new, "finished replacing it with the completed") if is_real_dir(new) and is_complete(new) \
            else (old, "put back the old")
        try:
            rename_durably(chosen, out)
        except OSError as exc:
            log.error("%s is missing: conversion %d was killed while replacing it; moving %s back failed (%s): "
                      "run colibri-convert again, or mv %s %s", out, pid, chosen, exc.strerror, chosen, out)
            return
        log.warning("%s was missing: conversion %d was killed while replacing it; %s pack (%s)",
                    out, pid, what, chosen.name)
        return


def remove_stale_leftovers(out: Path) -> None:
    """Delete what killed conversions to OUT left behind: partial packs always, old packs once
    OUT is in place again (recover_interrupted_swap runs first)."""
    marks = (PARTIAL_MARK, OLD_MARK) if os.path.lexists(out) else (PARTIAL_MARK,)
    for mark in marks:
        for _, path in leftovers(out, mark):
            log.info("removing %s left by an interrupted conversion", path)
            shutil.rmtree(path, ignore_errors=True)
