"""The README's run command: tools/demo.sh converts the default model, starts colibrid, asks it
to continue a prompt through colibrictl, stops it, and exits 0 leaving nothing behind."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[2] / "tools" / "demo.sh"


needs_console_scripts = pytest.mark.skipif(
    shutil.which("colibrid") is None or shutil.which("colibrictl") is None,
    reason="colibrid and colibrictl are not on PATH (pip install -e . puts them there)")


def _demo_env(tmp_path) -> dict:
    (tmp_path / "run").mkdir()
    return dict(os.environ, COLIBRI_PACK=str(tmp_path / "default.pack"), TMPDIR=str(tmp_path / "run"),
                COLIBRI_PROMPT="class Stack:", PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])


@needs_console_scripts
@pytest.mark.parametrize("name, shape", [(None, "4 layers of 16 experts"),
                                         ("colibri-olmoe64-stdlib", "8 layers of 64 experts")])
def test_the_demo_answers_and_cleans_up(tmp_path, name, shape):
    env = _demo_env(tmp_path)
    result = subprocess.run(["bash", str(DEMO)] + ([name] if name else []), capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("class Stack:") and len(result.stdout.strip()) > len("class Stack:")
    assert result.stdout.endswith("\n")
    # On a terminal stdout and stderr are one screen: the daemon's log goes to a file, so it cannot
    # cut into the answer; stderr has the conversion's summary, then the request's line only.
    assert "colibrid:" not in result.stdout
    converted, request = result.stderr.splitlines()
    assert converted.startswith("wrote ") and shape in converted, result.stderr
    assert request.startswith("colibrid: request ") and "generated" in request and "tokens/s" in request, result.stderr
    assert (tmp_path / "default.pack" / "manifest.json").is_file()
    assert list((tmp_path / "run").iterdir()) == []  # its socket directory is removed


def test_the_demo_names_the_shipped_models_when_asked_for_another(tmp_path):
    result = subprocess.run(["bash", str(DEMO), "no-such-model"], capture_output=True, text=True,
                            env=_demo_env(tmp_path), timeout=30)
    assert result.returncode == 2
    assert "no model named 'no-such-model'" in result.stderr
    assert "colibri-olmoe-stdlib" in result.stderr and "colibri-olmoe64-stdlib" in result.stderr
    assert not (tmp_path / "default.pack").exists()
