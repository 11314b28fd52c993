"""The listening socket: a stale file is replaced, a live daemon or a plain file is not, and a
directory other users could change is refused before anything is created in it."""

from __future__ import annotations

import os
import socket
import stat

import pytest

from colibrid.daemon.listener import ListenerError, open_listener


def test_close_removes_the_socket_file(socket_dir):
    listener = open_listener(socket_dir / "run" / "s.sock")
    assert listener.path.exists()
    listener.close()
    assert not listener.path.exists()


def test_a_file_replaced_meanwhile_is_left_alone(socket_dir):
    path = socket_dir / "s.sock"
    listener = open_listener(path)
    path.unlink()
    newcomer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    newcomer.bind(str(path))  # another daemon took the path over
    listener.close()
    assert path.exists()
    newcomer.close()


def test_a_live_listener_is_not_taken_over(socket_dir):
    path = socket_dir / "s.sock"
    first = open_listener(path)
    with pytest.raises(ListenerError, match="already serving"):
        open_listener(path)
    first.close()


def test_a_path_that_is_not_a_socket_is_refused(socket_dir):
    path = socket_dir / "s.sock"
    path.write_text("precious")
    with pytest.raises(ListenerError, match="is not a socket"):
        open_listener(path)
    assert path.read_text() == "precious"


# ---- hostile directories (StrictModes): nobody else may be able to swap what we bind or chown ----

NOBODY_UID = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give files to another user")


@pytest.fixture
def victim(socket_dir):
    """A file of mode 0600 that an attacker wants colibrid to chmod or chown."""
    path = socket_dir / "victim"
    path.write_text("secret")
    path.chmod(0o600)
    return path


def _untouched(victim) -> bool:
    st = victim.stat()
    return stat.S_IMODE(st.st_mode) == 0o600 and st.st_gid == os.getegid() and victim.read_text() == "secret"


def test_a_world_writable_directory_is_refused_and_a_planted_symlink_is_not_followed(socket_dir, victim):
    shared = socket_dir / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # no sticky bit: anyone may replace any name in it
    os.symlink(victim, shared / "s.sock")
    with pytest.raises(ListenerError, match=r"mode 0777 lets other users replace it; chmod go-w"):
        open_listener(shared / "s.sock", group="daemon")
    assert _untouched(victim)
    assert (shared / "s.sock").is_symlink()


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_directory_writable_by_group_or_others_is_refused_even_when_empty(socket_dir, mode):
    shared = socket_dir / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(ListenerError, match="lets other users replace it"):
        open_listener(shared / "s.sock")
    assert not (shared / "s.sock").exists()


def test_an_ancestor_writable_by_others_is_refused(socket_dir):
    shared = socket_dir / "shared"
    (shared / "mine").mkdir(parents=True)
    shared.chmod(0o777)  # others could rename mine/ away and put their own directory there
    with pytest.raises(ListenerError, match=f"under {shared}: mode 0777"):
        open_listener(shared / "mine" / "s.sock")


@needs_root
def test_a_directory_owned_by_another_user_is_refused(socket_dir):
    theirs = socket_dir / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY_UID, NOBODY_UID)
    with pytest.raises(ListenerError, match=f"owned by uid {NOBODY_UID}, neither root nor colibrid's user"):
        open_listener(theirs / "s.sock")


def test_a_sticky_world_writable_directory_like_tmp_is_fine(socket_dir):
    sticky = socket_dir / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    listener = open_listener(sticky / "s.sock")
    assert stat.S_ISSOCK(listener.path.lstat().st_mode)
    listener.close()


def test_the_socket_has_mode_0660_from_creation_whatever_the_umask(socket_dir):
    previous = os.umask(0)
    try:
        listener = open_listener(socket_dir / "s.sock")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(listener.path.lstat().st_mode) == 0o660
    listener.close()


def test_missing_directories_are_created_0755_under_umask_000(socket_dir):
    previous = os.umask(0)
    try:
        listener = open_listener(socket_dir / "a" / "b" / "s.sock")
    finally:
        os.umask(previous)
    for directory in (socket_dir / "a", socket_dir / "a" / "b"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o755, directory
    listener.close()


def test_a_socket_swapped_for_a_symlink_after_bind_leaves_the_target_alone(socket_dir, victim, monkeypatch):
    """An attacker racing bind(): the mode comes with the file, and the group change never follows a link."""

    class SwappedAfterBind(socket.socket):
        def bind(self, address):
            super().bind(address)
            os.unlink(address)
            os.symlink(victim, address)

    monkeypatch.setattr(socket, "socket", SwappedAfterBind)
    try:
        open_listener(socket_dir / "s.sock", group="daemon")
        refused = None
    except ListenerError as exc:
        refused = str(exc)
    assert _untouched(victim)
    assert refused is not None and "was replaced right after colibrid created it" in refused


def test_a_symlinked_directory_owned_by_root_is_followed_and_its_target_checked(socket_dir):
    real = socket_dir / "real"
    real.mkdir(mode=0o755)
    os.symlink(real, socket_dir / "link")
    listener = open_listener(socket_dir / "link" / "s.sock")
    assert (real / "s.sock").exists()
    listener.close()
    real.chmod(0o777)
    with pytest.raises(ListenerError, match=f"under {real}: mode 0777"):
        open_listener(socket_dir / "link" / "s.sock")


@needs_root
def test_a_symlinked_directory_owned_by_another_user_is_refused(socket_dir):
    sticky = socket_dir / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    (socket_dir / "real").mkdir(mode=0o755)
    os.symlink(socket_dir / "real", sticky / "link")
    os.lchown(sticky / "link", NOBODY_UID, NOBODY_UID)  # in /tmp, another user's link
    with pytest.raises(ListenerError, match=f"is a symlink owned by uid {NOBODY_UID}"):
        open_listener(sticky / "link" / "s.sock")
    assert not (socket_dir / "real" / "s.sock").exists()


@needs_root
def test_a_stale_socket_of_another_user_is_not_removed(socket_dir):
    sticky = socket_dir / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sticky / "s.sock"))
    stale.close()  # nobody listens: stale
    os.chown(sticky / "s.sock", NOBODY_UID, NOBODY_UID)
    with pytest.raises(ListenerError, match=f"stale socket of uid {NOBODY_UID}, not ours"):
        open_listener(sticky / "s.sock")
    assert (sticky / "s.sock").exists()


def test_our_own_stale_socket_is_replaced(socket_dir):
    path = socket_dir / "s.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()
    listener = open_listener(path)
    assert listener.path.exists()
    listener.close()
