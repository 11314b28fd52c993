"""`--version` of the three programs: each prints its name and the one version of the project,
pyproject.toml's, as pip recorded it."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("program, module", [
    ("colibrid", "colibrid"),
    ("colibrictl", "colibrictl"),
    ("colibri-convert", "colibrid.tools.convert.cli"),
    ("colibri-perplexity", "colibrid.tools.perplexity"),
])
def test_version_flag(program, module):
    result = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True,
                            cwd=REPO, timeout=60)

    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{program} {metadata.version('colibri')}\n"


def test_the_installed_version_is_pyprojects():
    """A stale install (version bumped, `pip install` not run again) shows here, not in a bug report."""
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]

    assert metadata.version("colibri") == declared
