"""The README a new user reads first: its links stay inside the repository, and its layout
table names every folder and every module of the daemon."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
LINK = re.compile(r"\]\(([^)#\s]+)")


def _relative_links(markdown: Path) -> list[str]:
    return [target for target in LINK.findall(markdown.read_text()) if "://" not in target]


@pytest.mark.parametrize("markdown", [README, *sorted((REPO / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_links_point_at_files_of_the_repository(markdown):
    for target in _relative_links(markdown):
        path = (markdown.parent / target).resolve()
        assert path.is_relative_to(REPO), f"{markdown.name} links {target}, outside the repository"
        assert path.exists(), f"{markdown.name} links {target}, which does not exist"


def test_the_readme_links_the_architecture_document():
    assert "docs/architecture.md" in _relative_links(README)


def _expand_braces(path: str) -> list[str]:
    """`colibrid/{a,b}.py` → colibrid/a.py, colibrid/b.py (the table's shorthand)."""
    match = re.search(r"\{([^}]*)\}", path)
    if not match:
        return [path]
    return [expanded for choice in match.group(1).split(",")
            for expanded in _expand_braces(path[:match.start()] + choice + path[match.end():])]


def _layout_paths() -> set[str]:
    layout = README.read_text().split("## Layout", 1)[1]
    first_cells = [line.split("|")[1] for line in layout.splitlines() if line.startswith("| `")]
    return {expanded for cell in first_cells for path in re.findall(r"`([^`]+)`", cell)
            for expanded in _expand_braces(path)}


def _tracked_entries() -> set[str]:
    """Every top-level folder (`bench/`), and every folder and module of the daemon
    (`colibrid/thermal/`, `colibrid/memory.py`)."""
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    entries = set()
    for name in files:
        parts = name.split("/")
        if parts[0] == "colibrid" and len(parts) > 1:
            entries.add("/".join(parts[:2]) + ("/" if len(parts) > 2 else ""))
        elif len(parts) > 1:
            entries.add(parts[0] + "/")
    return entries


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="not a git checkout")
def test_the_layout_table_lists_every_folder_and_module():
    missing = _tracked_entries() - _layout_paths()
    assert not missing, f"README.md's layout table does not list {sorted(missing)}"
