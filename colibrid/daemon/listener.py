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

colibrid usually runs as root or as its own user, and the socket path is a name other users may
be able to touch. Like OpenSSH's StrictModes, we only create a socket in a directory that nobody
else can change: the directory and every ancestor must be owned by root or by us and must not be
writable by group or others unless the sticky bit is set (as on /tmp, where others cannot remove
or rename our file). In such a directory nobody else can plant or swap a symlink at our path
between a check and its use, so what we check is what bind() and chown() then act on. The walk
itself goes one component at a time from "/" with file descriptors, following a symlink only if
root or we own it, and checking the directories it leads to as well. Directories it creates get
mode 0755 whatever the umask (the socket's own mode and group are the gate); the socket gets
its mode at creation (umask around bind()), and its group from an lchown-style call that never
follows a link.
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
        raise _already_served(path)


def _already_served(path: Path) -> ListenerError:
    return ListenerError(f"another colibrid is already serving on {path}; stop it first (or choose another --socket)")


def _passed_by_systemd() -> bool:
    """LISTEN_PID names this very process (else the fds were meant for the one that started us)."""
    listen_pid, listen_fds = os.environ.get("LISTEN_PID", ""), os.environ.get("LISTEN_FDS", "")
    return listen_pid.isdigit() and listen_fds.isdigit() and int(listen_pid) == os.getpid()


def inherited_listeners() -> list[Listener]:
    """Listening sockets passed by systemd to this very process; the LISTEN_* variables are consumed."""
    if not _passed_by_systemd():
        return []
    listen_fds = os.environ["LISTEN_FDS"]
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
    directory_fd = _open_trusted_directory(Path(os.path.abspath(path.parent)))
    try:
        _remove_if_stale(path, directory_fd)
        sock = _bind(path)
        try:
            # Between bind() and listen() every connect() is refused, so setting the group here
            # leaves no moment in which the socket is open to more users than intended.
            inode = _check_is_our_socket(path, directory_fd)
            _set_group(path, directory_fd, group)
            sock.listen(LISTEN_BACKLOG)
        except (OSError, ListenerError) as exc:
            sock.close()
            if isinstance(exc, ListenerError):
                raise
            raise ListenerError(f"cannot listen on {path}: {exc.strerror}") from None
    finally:
        os.close(directory_fd)
    sock.setblocking(False)
    return Listener(sock, os.fspath(path), inode)


def _bind(path: Path) -> socket.socket:
    """A socket bound at `path`, created with SOCKET_MODE: never a moment with a wider mode, no chmod by name.

    bind() creates the file with 0777 minus the umask; the umask is process-wide, but nothing
    else creates files while the daemon starts (the engine is loaded, its threads only read).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    previous_umask = os.umask(0o777 & ~SOCKET_MODE)
    try:
        sock.bind(os.fspath(path))
    except OSError as exc:
        sock.close()
        raise ListenerError(f"cannot listen on {path}: {exc.strerror}") from None
    finally:
        os.umask(previous_umask)
    return sock


def _check_is_our_socket(path: Path, directory_fd: int) -> int:
    """The inode of the socket bind() just made; refuse if something else is at the name by now."""
    st = os.stat(path.name, dir_fd=directory_fd, follow_symlinks=False)
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
        raise ListenerError(f"{path} was replaced right after colibrid created it; "
                            "check who else can write to its directory")
    return st.st_ino


def _set_group(path: Path, directory_fd: int, group: str) -> None:
    if not group:
        return
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        log.debug("group %s does not exist; %s keeps the group %d", group, path,
                  os.stat(path.name, dir_fd=directory_fd, follow_symlinks=False).st_gid)
        return
    if os.stat(path.name, dir_fd=directory_fd, follow_symlinks=False).st_gid == gid:
        return  # already (colibrid running as that group): no chown, which a seccomp filter may forbid
    try:
        # follow_symlinks=False: should the name be a link by now, the link changes group, never its target.
        os.chown(path.name, -1, gid, dir_fd=directory_fd, follow_symlinks=False)
    except PermissionError:
        log.warning("cannot give %s to group %s (colibrid is neither root nor a member); "
                    "only its own user can connect", path, group)


def _remove_if_stale(path: Path, directory_fd: int) -> None:
    try:
        st = os.stat(path.name, dir_fd=directory_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ListenerError(f"{path} exists and is not a socket; remove it or choose another --socket")
    if _answers(path):
        raise _already_served(path)
    if st.st_uid not in _trusted_owners():
        # In a sticky directory (/tmp) another user may leave a dead socket at our path; it is
        # theirs, not a leftover of ours, and they could swap it for something else meanwhile.
        raise ListenerError(f"{path} is a stale socket of uid {st.st_uid}, not ours; "
                            "remove it (as that user or root) or choose another --socket")
    log.info("removing stale socket %s (nobody answers on it)", path)
    os.unlink(path.name, dir_fd=directory_fd)  # unlink never follows a link


# -- the socket's directory, StrictModes style ------------------------------------------------

MAX_SYMLINKS = 40  # as the kernel's path walk (ELOOP)
CREATED_DIRECTORY_MODE = 0o755  # others may reach the socket; its own mode and group decide who connects


def _trusted_owners() -> tuple[int, ...]:
    return (0, os.geteuid())


def _open_trusted_directory(directory: Path) -> int:
    """An O_PATH fd of `directory` (absolute), reached from "/" one component at a time.

    Every directory on the way, the last included, must pass _check_trusted; a missing one is
    created (CREATED_DIRECTORY_MODE); a symlink is followed only if root or we own it, and the
    directories it leads to are checked like the others. Raises ListenerError saying what to fix.
    """
    stack = [_open_directory("/", None)]  # fds of the directories walked so far, "/" first
    shown = ["/"]  # their names, for messages
    try:
        _check_trusted(stack[-1], "/")
        pending = list(directory.parts[1:])
        links_followed = 0
        while pending:
            name = pending.pop(0)
            if name in ("", "."):
                continue
            if name == "..":
                if len(stack) > 1:
                    os.close(stack.pop())
                    shown.pop()
                continue
            where = os.path.join(shown[-1], name)
            target = _symlink_target(stack[-1], name, where)
            if target is not None:
                links_followed += 1
                if links_followed > MAX_SYMLINKS:
                    raise ListenerError(f"too many symlinks on the way to {directory}")
                if target.startswith("/"):
                    while len(stack) > 1:
                        os.close(stack.pop())
                        shown.pop()
                pending[:0] = Path(target).parts[1 if target.startswith("/") else 0:]
                continue
            stack.append(_open_or_create_directory(stack[-1], name, where))
            shown.append(where)
            _check_trusted(stack[-1], where)
        return stack.pop()
    except OSError as exc:
        raise ListenerError(f"cannot use the socket directory {directory}: {exc.strerror}") from None
    finally:
        for fd in stack:
            os.close(fd)


def _symlink_target(parent_fd: int, name: str, where: str) -> str | None:
    """The target of `name` if it is a symlink we may follow, None if it is not a symlink (or missing)."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if not stat.S_ISLNK(st.st_mode):
        return None
    if st.st_uid not in _trusted_owners():
        raise ListenerError(f"refusing the socket path: {where} is a symlink owned by uid {st.st_uid}, "
                            "who could point it anywhere; use a path without it")
    return os.readlink(name, dir_fd=parent_fd)


def _open_directory(name: str, parent_fd: int | None) -> int:
    return os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)


def _open_or_create_directory(parent_fd: int, name: str, where: str) -> int:
    try:
        return _open_directory(name, parent_fd)
    except FileNotFoundError:
        pass
    try:
        os.mkdir(name, CREATED_DIRECTORY_MODE, dir_fd=parent_fd)
    except FileExistsError:
        return _open_directory(name, parent_fd)  # created meanwhile by someone the parent trusts
    # mkdir() applied the umask (under umask 000 the directory would be world-writable): set
    # the mode on what we created, through a descriptor, not by name.
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)
    try:
        os.fchmod(fd, CREATED_DIRECTORY_MODE)
    finally:
        os.close(fd)
    log.debug("created the socket directory %s (mode %04o)", where, CREATED_DIRECTORY_MODE)
    return _open_directory(name, parent_fd)


def _check_trusted(fd: int, where: str) -> None:
    """Refuse a directory that someone other than root or us could change (OpenSSH's StrictModes)."""
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode):
        raise ListenerError(f"cannot use the socket path: {where} is not a directory")
    if st.st_uid not in _trusted_owners():
        raise ListenerError(f"refusing to create the socket under {where}: it is owned by uid {st.st_uid}, "
                            f"neither root nor colibrid's user ({os.geteuid()}); chown it or choose another --socket")
    writable_by_others = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable_by_others and not st.st_mode & stat.S_ISVTX:
        raise ListenerError(f"refusing to create the socket under {where}: mode {stat.S_IMODE(st.st_mode):04o} "
                            "lets other users replace it; chmod go-w (or +t, as /tmp) it, or choose another --socket")


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

