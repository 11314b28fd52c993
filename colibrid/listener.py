"""The listening Unix socket: the one place that decides where clients connect.

A socket file can outlive its daemon (a crash, a kill -9), and then it only refuses
connections. So before binding, the path is probed: if a daemon answers there, starting a
second one would steal its clients, and we refuse; if nobody answers, the file is stale and is
replaced. On the way out we remove the file only if it is still ours - another daemon may have
replaced it meanwhile.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# A live daemon accepts at once (the kernel completes the connection before accept());
# the probe waits this long only for a daemon that is wedged.
PROBE_TIMEOUT_S = 1.0
LISTEN_BACKLOG = 128


class ListenerError(Exception):
    """The socket cannot be bound; str() says why and what to do."""


@dataclass
class Listener:
    sock: socket.socket  # bound, listening, non-blocking
    path: Path
    inode: int  # of the socket file as we created it, to recognise it at close

    def close(self) -> None:
        """Close the socket and remove its file if the file is still the one we created."""
        self.sock.close()
        if _inode(self.path) == self.inode:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass


def open_listener(path: Path) -> Listener:
    """A bound, listening Unix stream socket at `path`, its directory created if need be."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ListenerError(f"cannot create the socket directory {path.parent}: {exc.strerror}") from None
    _remove_if_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(os.fspath(path))
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise ListenerError(f"cannot listen on {path}: {exc.strerror}") from None
    sock.setblocking(False)
    return Listener(sock, path, path.lstat().st_ino)


def _remove_if_stale(path: Path) -> None:
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ListenerError(f"{path} exists and is not a socket; remove it or choose another --socket")
    if _answers(path):
        raise ListenerError(f"another colibrid is already serving on {path}; stop it first "
                            "(or choose another --socket)")
    log.info("removing stale socket %s (nobody answers on it)", path)
    path.unlink()


def _answers(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(PROBE_TIMEOUT_S)
    try:
        probe.connect(os.fspath(path))
        return True
    except socket.timeout:
        return True  # something holds the socket open but is slow: not ours to take over
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return False
        raise ListenerError(f"cannot probe {path}: {exc.strerror}") from None
    finally:
        probe.close()


def _inode(path: Path) -> int | None:
    try:
        return path.lstat().st_ino
    except OSError:
        return None

