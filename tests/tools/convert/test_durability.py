"""A conversion is durable: every file of the pack, the manifest last, the pack directory and
its parent are fsync'ed. A --force run killed between its two renames (old pack aside, new
one not yet in place) is repaired by the next run, which finishes the swap."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path


from tests.tiny_checkpoints import CheckpointSpec

SPEC = CheckpointSpec("olmoe")

# colibri-convert, killed (os._exit, as SIGKILL would) at the rename that puts the new pack in place.
KILLED_BETWEEN_RENAMES = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    out = Path(sys.argv[2]).absolute()
    real_rename = os.rename
    def rename(src, dst, *args, **kwargs):
        if Path(dst).absolute() == out:
            os._exit(137)
        return real_rename(src, dst, *args, **kwargs)
    os.rename = rename
    from colibrid.tools.convert.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def convert_killed_between_renames(checkpoint: Path, out: Path, quant: str) -> int:
    """Run a --force conversion that dies between its two renames; its PID."""
    proc = subprocess.Popen([sys.executable, "-c", KILLED_BETWEEN_RENAMES, str(checkpoint), str(out), "--force",
                             "--quiet", "--quant", quant], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 137, stderr
    return proc.pid  # the child itself ran the conversion: the leftovers carry its PID


def _quant(pack: Path) -> str:
    return json.loads((pack / "manifest.json").read_text())["quantization"]["dense"]


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "colibrid.tools.convert.cli", *args, "--quiet"],
                          capture_output=True, text=True, timeout=300)


def test_killed_between_renames_leaves_old_pack_aside_and_the_next_run_repairs_it(packs, tmp_path):
    checkpoint = packs.checkpoint(SPEC)
    out = tmp_path / "out.pack"
    assert _run_cli(str(checkpoint), str(out), "--quant", "f32").returncode == 0
    pid = convert_killed_between_renames(checkpoint, out, "q8_0")
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".out.pack.old-{pid}", f".out.pack.partial-{pid}"]

    result = _run_cli(str(checkpoint), str(out), "--quant", "q4_g64")  # no --force: the repaired pack is there
    assert result.returncode == 1 and "--force" in result.stderr
    assert _quant(out) == "q8_0"  # the killed run's pack was complete: the swap was finished
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.pack"]  # the old pack removed

    assert _run_cli(str(checkpoint), str(out), "--force", "--quant", "q4_g64").returncode == 0
    assert _quant(out) == "q4_g64"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.pack"]


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def test_every_file_and_directory_is_fsynced_manifest_last(packs, tmp_path, monkeypatch):
    from colibrid.tools.convert.converter import convert
    from colibrid.tools.convert.quant_spec import parse_quant

    checkpoint = packs.checkpoint(SPEC)
    out = tmp_path / "out.pack"
    synced: list[str] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(_fd_path(fd)), real_fsync(fd))[1])
    convert(checkpoint, out, parse_quant("q8_0"), progress=False)

    partial = str(tmp_path / f".out.pack.partial-{os.getpid()}")
    files = sorted(p.name for p in out.iterdir())
    assert "manifest.json" in files and "tokenizer.json" in files and "source_config.json" in files
    for name in files:  # the manifest is written under a temporary name, then renamed
        names = (name, f".{name}.partial-{os.getpid()}")
        assert any(s.startswith(partial + "/") and s.rsplit("/", 1)[-1] in names for s in synced), f"{name} not fsynced"
    manifest_synced = max(i for i, s in enumerate(synced) if "manifest.json" in s)
    data_synced = [i for i, s in enumerate(synced) if s.startswith(partial + "/") and "manifest.json" not in s]
    assert max(data_synced) < manifest_synced  # the manifest, which marks the pack complete, comes last
    assert synced.index(partial, manifest_synced) > manifest_synced  # then the pack directory
    assert synced[-1] == str(tmp_path)  # and the parent, after the rename into place
