"""Access: the socket's mode and group, peer credentials in the log, and `forbidden` for refused peers.

The refused client runs as `nobody`, in a forked child that drops to that user before connecting.
"""

from __future__ import annotations

import grp
import os
import re
import pwd
import socket
import stat
import struct

import msgpack
import pytest

from tests.daemon.wire import WireClient, wait_for_socket

NOBODY = pwd.getpwnam("nobody")
NOGROUP = grp.getgrgid(NOBODY.pw_gid).gr_name

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="running a client as another user needs root")


def hello_as_nobody(socket_path) -> dict | str:
    """The reply to a hello sent by a process running as nobody; an OSError's name if it could not connect."""
    frame = msgpack.packb({"op": "hello", "id": "h", "protocol": 1}, use_bin_type=True)
    frame = struct.pack(">I", len(frame)) + frame
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no Python-level cleanup, only syscalls, then _exit
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(NOBODY.pw_gid)
            os.setuid(NOBODY.pw_uid)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(20)
            try:
                sock.connect(str(socket_path))
                sock.sendall(frame)
                reply = b""
                while len(reply) < 4 or len(reply) < 4 + struct.unpack(">I", reply[:4])[0]:
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    reply += chunk
            except OSError as exc:
                reply = b"E" + type(exc).__name__.encode()
            os.write(write_end, reply)
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    if data.startswith(b"E"):
        return data[1:].decode()
    return msgpack.unpackb(data[4:], raw=False)


def test_the_socket_is_0660_and_belongs_to_the_configured_group(start_service, work_dir):
    service = start_service("--socket-group", NOGROUP)
    wait_for_socket(work_dir / "colibrid.sock", service.proc)
    info = (work_dir / "colibrid.sock").stat()
    assert stat.S_IMODE(info.st_mode) == 0o660
    assert info.st_gid == NOBODY.pw_gid
    assert hello_as_nobody(work_dir / "colibrid.sock")["event"] == "hello"  # the group may connect


def test_without_the_group_another_user_cannot_even_connect(start_service, work_dir):
    service = start_service("--socket-group", "")
    wait_for_socket(work_dir / "colibrid.sock", service.proc)
    assert hello_as_nobody(work_dir / "colibrid.sock") == "PermissionError"


def test_a_peer_not_in_allow_users_or_allow_groups_gets_forbidden(start_service, work_dir):
    service = start_service("--socket-group", NOGROUP, "--allow-users", "daemon", "--allow-groups", "adm")
    wait_for_socket(work_dir / "colibrid.sock", service.proc)
    reply = hello_as_nobody(work_dir / "colibrid.sock")
    assert (reply["event"], reply["code"], reply["id"]) == ("error", "forbidden", "h")
    with WireClient(work_dir / "colibrid.sock") as client:  # root is always allowed
        assert client.hello()["event"] == "hello"
    returncode, stderr = service.stop()
    assert returncode == 0
    assert "uid 65534 (nobody)" in stderr and "refused: not in allow_users or allow_groups" in stderr


def test_a_peer_in_an_allowed_group_is_served(start_service, work_dir):
    service = start_service("--socket-group", NOGROUP, "--allow-groups", NOGROUP)
    wait_for_socket(work_dir / "colibrid.sock", service.proc)
    assert hello_as_nobody(work_dir / "colibrid.sock")["event"] == "hello"


def test_each_request_is_logged_with_its_peer_credentials(start_service, work_dir):
    service = start_service("--log-level", "debug")
    wait_for_socket(work_dir / "colibrid.sock", service.proc)
    with WireClient(work_dir / "colibrid.sock") as client:
        client.hello()
        client.ask("q", max_tokens=2)
        client.collect("q")
    _, stderr = service.stop()
    me = f"uid 0 (root) gid 0 pid {os.getpid()}"
    # Earlier connections were the daemon's own check before READY and wait_for_socket's probes.
    asked = re.search(rf"connection (\d+) \({re.escape(me)}\): ask 'q', max_tokens 2", stderr)
    assert asked, stderr
    assert f"request 'q' from connection {asked.group(1)} ({me}): " in stderr
