"""The listening Unix socket(s): the one place that decides where clients connect.

Under socket activation systemd binds the socket (colibrid.socket) and passes it to us as an
inherited file descriptor (sd_listen_fds(3): LISTEN_PID is our pid, LISTEN_FDS how many, from
fd 3 on); then those are served and the configured path is not used. Otherwise we bind the
configured path ourselves, with mode 0660 and the configured group.

A socket file can outlive its daemon (a crash, a kill -9), and then it only refuses
connections. So before binding, the path is probed: if a daemon answers there, starting a
second one would steal its clients, and we refuse; if nobody answers, the file is stale and is
replaced. On the way out we remove the file only if it is still ours - another daemon may have
replaced it meanwhile.
"""

from __future__ import annotations

import errno
import grp
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
# Owner and group may connect (connect() needs write permission on the file), nobody else.
SOCKET_MODE = 0o660
SD_LISTEN_FDS_START = 3  # sd_listen_fds(3): inherited sockets start at fd 3


class ListenerError(Exception):
    """The socket cannot be bound; str() says why and what to do."""


@dataclass
class Listener:
    sock: socket.socket  # bound, listening, non-blocking
    address: str  # for the log and for probing: a path, or "@name" for an abstract socket
    inode: int | None  # of the socket file as we created it, to recognise it at close; None: not ours

    @property
    def path(self) -> Path:
        return Path(self.address)

    @property
    def inherited(self) -> bool:
        return self.inode is None

    def close(self) -> None:
        """Close the socket; remove its file if we created it and the file is still that one.

        An inherited socket's file belongs to systemd, which keeps listening on it after we exit
        (the next connection starts us again), so it is never removed.
        """
        self.sock.close()
        if self.inode is not None and _inode(Path(self.address)) == self.inode:
            try:
                Path(self.address).unlink()
            except FileNotFoundError:
                pass


def open_listeners(path: Path, group: str = "") -> list[Listener]:
    """The sockets to serve: the ones systemd passed us, else one bound at `path`."""
    inherited = inherited_listeners()
    return inherited if inherited else [open_listener(path, group)]


def check_free(path: Path) -> None:
    """Raises ListenerError if a daemon answers at `path` (unless systemd passes us our
    sockets, and the path is not ours to bind). Called before the model is loaded, so a second
    colibrid gives up before it costs the machine memory or hugepages; open_listener checks
    again when it binds."""
    if _passed_by_systemd():
        return
    try:
        mode = path.lstat().st_mode
    except OSError:
        return
    if stat.S_ISSOCK(mode) and _answers(path):
        raise ListenerError(f"another colibrid is already serving on {path}; stop it first "
                            "(or choose another --socket)")


def _passed_by_systemd() -> bool:
    listen_pid, listen_fds = os.environ.get("LISTEN_PID", ""), os.environ.get("LISTEN_FDS", "")
    return listen_pid.isdigit() and listen_fds.isdigit() and int(listen_pid) == os.getpid()


def inherited_listeners() -> list[Listener]:
    """Listening sockets passed by systemd to this very process; the LISTEN_* variables are consumed."""
    listen_pid, listen_fds = os.environ.get("LISTEN_PID", ""), os.environ.get("LISTEN_FDS", "")
    if not (listen_pid.isdigit() and listen_fds.isdigit()) or int(listen_pid) != os.getpid():
        return []  # not set, or meant for the process that started us (then the fds are not ours either)
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(name, None)  # so that nothing we start believes the sockets are its own
    listeners = []
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + int(listen_fds)):
        try:
            sock = socket.socket(fileno=fd)
        except OSError as exc:
            raise ListenerError(f"inherited fd {fd} (LISTEN_FDS={listen_fds}) is not a socket: {exc.strerror}") from None
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM or not sock.getsockopt(
                socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise ListenerError(f"inherited fd {fd} is not a listening Unix stream socket; "
                                "use ListenStream=/path in colibrid.socket")
        os.set_inheritable(fd, False)
        sock.setblocking(False)
        listeners.append(Listener(sock, _address(sock), None))
    return listeners


def _address(sock: socket.socket) -> str:
    name = sock.getsockname()
    if isinstance(name, bytes):  # abstract namespace: a leading NUL byte
        return "@" + name[1:].decode(errors="replace")
    return name or "(unnamed)"


def open_listener(path: Path, group: str = "") -> Listener:
    """A bound, listening Unix stream socket at `path` (mode 0660, `group` if it exists), its directory created."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ListenerError(f"cannot create the socket directory {path.parent}: {exc.strerror}") from None
    _remove_if_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(os.fspath(path))
        # Between bind() and listen() every connect() is refused, so setting the mode and group
        # here leaves no moment in which the file is open to more users than intended.
        os.chmod(path, SOCKET_MODE)
        _set_group(path, group)
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise ListenerError(f"cannot listen on {path}: {exc.strerror}") from None
    sock.setblocking(False)
    return Listener(sock, os.fspath(path), path.lstat().st_ino)


def _set_group(path: Path, group: str) -> None:
    if not group:
        return
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        log.debug("group %s does not exist; %s keeps the group %d", group, path, path.lstat().st_gid)
        return
    if path.lstat().st_gid == gid:
        return  # already (colibrid running as that group): no chown, which a seccomp filter may forbid
    try:
        os.chown(path, -1, gid)
    except PermissionError:
        log.warning("cannot give %s to group %s (colibrid is neither root nor a member); "
                    "only its own user can connect", path, group)


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

