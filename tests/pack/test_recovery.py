"""Pack.open (the daemon's start) repairs a pack that a `colibri-convert --force` killed
between its two renames left aside: it finishes the swap when the new pack is complete,
else puts the old one back; it touches only directories of that name pattern, of dead
PIDs, and never through a symbolic link."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.tools.convert.test_durability import convert_killed_between_renames
from tests.tiny_checkpoints import CheckpointSpec

SPEC = CheckpointSpec("olmoe")


@pytest.fixture
def killed_swap(packs, tmp_path):
    """(out, pid): an f32 pack at out, replaced by a q8_0 conversion killed between its renames."""
    out = tmp_path / "model.pack"
    shutil.copytree(packs.pack(SPEC, "f32"), out)
    return out, convert_killed_between_renames(packs.checkpoint(SPEC), out, "q8_0")


def _dense_quant(pack) -> str:
    return pack.manifest.quantization["dense"]


def test_open_finishes_the_swap_when_the_new_pack_is_complete(killed_swap, caplog):
    from colibrid.pack import Pack

    out, pid = killed_swap
    pack = Pack.open(out)
    assert _dense_quant(pack) == "q8_0"
    assert not (out.parent / f".model.pack.partial-{pid}").exists()
    assert f"conversion {pid} was killed while replacing it" in caplog.text


def test_open_puts_the_old_pack_back_when_the_new_one_is_incomplete(killed_swap, caplog):
    from colibrid.pack import Pack

    out, pid = killed_swap
    (out.parent / f".model.pack.partial-{pid}" / "manifest.json").unlink()  # as if killed before it was written
    pack = Pack.open(out)
    assert _dense_quant(pack) == "f32"
    assert not (out.parent / f".model.pack.old-{pid}").exists()
    assert "put back the old pack" in caplog.text


def test_leftovers_of_a_running_pid_are_left_alone(killed_swap):
    from colibrid.pack import Pack, PackError

    out, pid = killed_swap
    alive = os.getpid()  # pretend the conversion is still running: ours is a live PID
    for kind in ("old", "partial"):
        os.rename(out.parent / f".model.pack.{kind}-{pid}", out.parent / f".model.pack.{kind}-{alive}")
    with pytest.raises(PackError, match="does not exist"):
        Pack.open(out)
    assert (out.parent / f".model.pack.old-{alive}").is_dir()


def test_a_symlink_named_like_a_leftover_is_not_followed(killed_swap, tmp_path):
    from colibrid.pack import Pack, PackError

    out, pid = killed_swap
    elsewhere = tmp_path / "elsewhere"
    os.rename(out.parent / f".model.pack.old-{pid}", elsewhere)
    shutil.rmtree(out.parent / f".model.pack.partial-{pid}")
    (out.parent / f".model.pack.old-{pid}").symlink_to(elsewhere)
    with pytest.raises(PackError, match="does not exist"):
        Pack.open(out)
    assert (out.parent / f".model.pack.old-{pid}").is_symlink() and elsewhere.is_dir()
    assert not os.path.lexists(out)
