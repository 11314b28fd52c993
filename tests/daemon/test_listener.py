"""The listening socket: a stale file is replaced, a live daemon or a plain file is not."""

from __future__ import annotations

import socket

import pytest

from colibrid.listener import ListenerError, open_listener


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
