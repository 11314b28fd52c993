"""Who is on the other end of a connection, and whether they may use the daemon.

The kernel records the peer's credentials when a Unix stream socket connects (SO_PEERCRED:
pid, uid, gid; SO_PEERGROUPS: its supplementary groups). They cannot be forged by the client,
unlike anything it could say in `hello`, so they are what the log shows and what
allow_users / allow_groups are checked against.

The socket's mode and group are the first gate (who can connect at all); this is the second,
for finer rules without managing groups. Root and colibrid's own user are always allowed:
they could read the daemon's memory anyway, so refusing them would only look like security.
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import socket
import struct
from dataclasses import dataclass

log = logging.getLogger(__name__)

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
# Not in Python's socket module; Linux 4.13 and later (asm-generic/socket.h).
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_MAX_PEER_GROUPS = 256


@dataclass(frozen=True)
class PeerCredentials:
    pid: int
    uid: int
    gid: int
    groups: frozenset[int]  # primary and supplementary

    @property
    def user_name(self) -> str:
        try:
            return pwd.getpwuid(self.uid).pw_name
        except KeyError:
            return str(self.uid)

    def describe(self) -> str:
        """For the log: `uid 1000 (alice) gid 1000 pid 4242`."""
        return f"uid {self.uid} ({self.user_name}) gid {self.gid} pid {self.pid}"


def peer_credentials(sock: socket.socket) -> PeerCredentials | None:
    """The credentials of a connected Unix socket's peer; None if the kernel has none to give."""
    try:
        pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    except OSError:
        return None
    groups = {gid}
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * _MAX_PEER_GROUPS)
        groups.update(struct.unpack(f"{len(raw) // 4}I", raw))
    except OSError:
        pass  # an older kernel: the primary group is all we know
    return PeerCredentials(pid, uid, gid, frozenset(groups))


class AccessPolicy:
    """allow_users / allow_groups resolved to ids once (at start and on reload), checked per connection."""

    def __init__(self, allow_users: tuple[str | int, ...] = (), allow_groups: tuple[str | int, ...] = ()) -> None:
        self.restricted = bool(allow_users or allow_groups)
        self._uids = {_resolve(name, _uid_of, "user") for name in allow_users} - {None}
        self._gids = {_resolve(name, _gid_of, "group") for name in allow_groups} - {None}
        self._always = {0, os.getuid()}

    def allows(self, peer: PeerCredentials | None) -> bool:
        if not self.restricted:
            return True
        if peer is None:
            return False
        return peer.uid in self._always or peer.uid in self._uids or bool(peer.groups & self._gids)


def _uid_of(name: str) -> int:
    return pwd.getpwnam(name).pw_uid


def _gid_of(name: str) -> int:
    return grp.getgrnam(name).gr_gid


def _resolve(name: str | int, lookup, kind: str) -> int | None:
    if isinstance(name, int):
        return name
    try:
        return lookup(name)
    except KeyError:
        log.warning("allow_%ss names %s, which is not a %s on this machine; ignored", kind, name, kind)
        return None


def may_administer(peer: PeerCredentials | None) -> bool:
    """Whether a peer may run the daemon's administrative requests (`verify`): root and
    colibrid's own user only. A verify reads the whole pack - disk time every client shares,
    even at idle priority - and its findings describe the files on the server."""
    return peer is not None and peer.uid in (0, os.getuid())
