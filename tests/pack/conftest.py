"""A writable copy of a small quantized pack for tests that damage one, and the damage."""

from __future__ import annotations

import shutil

import pytest

from tests.tiny_checkpoints import CheckpointSpec

SPEC = CheckpointSpec("olmoe")


@pytest.fixture
def pack_copy(packs, tmp_path):
    return shutil.copytree(packs.pack(SPEC, "q8_0"), tmp_path / "pack")


def flip_byte(path, offset: int, mask: int = 0x01) -> None:
    """XOR the byte at ``offset`` of the file at ``path`` with ``mask``, in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


def assert_refused_after(pack, mutate, fragments) -> None:
    """Apply ``mutate`` to the pack's parsed manifest.json, write it back, and check that
    Pack.open refuses the pack with an error containing every one of ``fragments``."""
    import json

    from colibrid.pack import Pack, PackError

    path = pack / "manifest.json"
    manifest = json.loads(path.read_text())
    mutate(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(PackError) as info:
        Pack.open(pack)
    for fragment in fragments:
        assert fragment in str(info.value)
