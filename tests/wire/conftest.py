"""Fixtures for the protocol's own tests: a socket path short enough for a Unix socket."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest


@pytest.fixture
def socket_path():
    # Not tmp_path: a Unix socket path must fit in 108 bytes, and pytest's can be longer.
    directory = tempfile.mkdtemp(prefix="wire-")
    yield os.path.join(directory, "colibrid.sock")
    shutil.rmtree(directory, ignore_errors=True)
