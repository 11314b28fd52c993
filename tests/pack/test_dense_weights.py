"""Dense weights: read into memory at open, so a later change to dense.bin cannot reach a
running engine; each tensor carries a CRC-32C checked at open, so damage shows at start
and names the tensor; packs of format version 1 (no checksums) load with a warning."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests.pack.conftest import SPEC, flip_byte


def _as_version_1(pack_dir):
    """Rewrite the manifest as a format version 1 converter wrote it: no dense checksums."""
    path = pack_dir / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["format_version"] = 1
    for entry in manifest["dense"]["tensors"].values():
        del entry["crc32c"]
    path.write_text(json.dumps(manifest))


def test_every_dense_tensor_has_its_checksum(packs):
    from colibrid import native
    from colibrid.pack import FORMAT_VERSION, Pack

    path = packs.pack(SPEC, "q8_0")
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format_version"] == FORMAT_VERSION == 2
    dense = (path / "dense.bin").read_bytes()
    for name, entry in Pack.open(path).manifest.dense_tensors.items():
        assert entry.crc32c == native.crc32c(dense[entry.offset : entry.offset + entry.nbytes]), name


@pytest.mark.parametrize("tensor, at", [("layers.1.attn.v", 5), ("embed", -1), ("final_norm", 0)])
def test_flipped_byte_in_dense_bin_fails_at_open_naming_the_tensor(pack_copy, tensor, at):
    from colibrid.pack import Pack, PackError

    entry = Pack.open(pack_copy).manifest.dense_tensors[tensor]
    flip_byte(pack_copy / "dense.bin", entry.offset + at % entry.nbytes)
    with pytest.raises(PackError, match=f"dense tensor '{tensor}' \\(dense.bin bytes {entry.offset}\\.\\."):
        Pack.open(pack_copy)


def test_version_1_pack_loads_with_a_warning_saying_how_to_upgrade(pack_copy, caplog):
    from colibrid.pack import Pack

    _as_version_1(pack_copy)
    with caplog.at_level(logging.WARNING, logger="colibrid.pack.reader"):
        pack = Pack.open(pack_copy)
    assert pack.manifest.format_version == 1
    assert len(pack.notes) == 1 and "no dense checksums" in pack.notes[0] and "re-convert" in pack.notes[0]
    assert pack.notes[0] in caplog.text
    # No checksum, so a flipped byte is not found (that is what the warning says).
    flip_byte(pack_copy / "dense.bin", pack.manifest.dense_tensors["embed"].offset)
    Pack.open(pack_copy)


def test_dense_tensors_are_read_only_views_of_memory_not_of_the_file(pack_copy):
    from colibrid.pack import Pack

    pack = Pack.open(pack_copy)
    embed = pack.dense("embed").data
    assert not embed.flags.writeable
    assert not isinstance(embed.base, np.memmap) and not isinstance(embed, np.memmap)
    before = embed.copy()
    with open(pack_copy / "dense.bin", "r+b") as f:
        f.write(b"\xff" * 4096)  # changed in place: a mapping would see it
    np.testing.assert_array_equal(embed, before)


def test_dense_bin_that_is_a_symlink_is_refused(pack_copy, tmp_path):
    from colibrid.pack import Pack, PackError

    shutil.move(pack_copy / "dense.bin", tmp_path / "dense.bin")
    (pack_copy / "dense.bin").symlink_to(tmp_path / "dense.bin")
    with pytest.raises(PackError, match="dense.bin"):
        Pack.open(pack_copy)


# The engine in a child process: on a mapped dense.bin, truncating the file kills it with SIGBUS.
ENGINE_SCRIPT = textwrap.dedent("""
    import sys
    from colibrid.engine import load
    engine = load(sys.argv[1])
    ids = engine.tokenizer.encode("def fibonacci(n):")
    print(engine.greedy(ids, 8), flush=True)
    sys.stdin.readline()  # the test changes dense.bin now
    print(engine.greedy(ids, 8), flush=True)
""")


@pytest.mark.parametrize("change", ["truncated", "rewritten"])
def test_engine_keeps_answering_when_dense_bin_changes_under_it(pack_copy, change):
    dense = pack_copy / "dense.bin"
    original = dense.read_bytes()
    child = subprocess.Popen([sys.executable, "-c", ENGINE_SCRIPT, str(pack_copy)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = child.stdout.readline()
        assert first.startswith("["), child.stderr.read()
        with open(dense, "r+b") as f:  # what `cp other.bin dense.bin` does: truncate, then write
            f.truncate(0)
            if change == "rewritten":
                f.write(bytes(len(original)))
        child.stdin.write("go\n")
        child.stdin.flush()
        second = child.stdout.readline()
        child.wait(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 0, f"the engine died ({child.returncode}): {child.stderr.read()}"
    assert second == first
