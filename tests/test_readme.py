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
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _markdown_files() -> list[Path]:
    """Every document of the repository: the README, docs/, the shipped models' cards."""
    return [README, *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "models").glob("*/README.md"))]


def _links(markdown: Path) -> list[tuple[str, str]]:
    """(path, anchor) of every relative link outside code blocks; path "" for one into itself."""
    text = FENCE.sub("", markdown.read_text())
    found = []
    for target in LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        found.append((path, anchor))
    return found


def _relative_links(markdown: Path) -> list[str]:
    return [path for path, _ in _links(markdown) if path]


def anchor_of(heading: str) -> str:
    """The anchor a heading gets where the documents are read (GitHub's rule): lower case,
    markup and punctuation dropped except - and _, spaces to -."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def _anchors(markdown: Path) -> set[str]:
    """Every heading's anchor; a repeated heading gets -1, -2 ... as GitHub numbers them."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in HEADING.findall(FENCE.sub("", markdown.read_text())):
        anchor = anchor_of(heading)
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        anchors.add(anchor if count == 0 else f"{anchor}-{count}")
    return anchors


@pytest.mark.parametrize("markdown", _markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_links_point_at_files_of_the_repository(markdown):
    for target in _relative_links(markdown):
        path = (markdown.parent / target).resolve()
        assert path.is_relative_to(REPO), f"{markdown.name} links {target}, outside the repository"
        assert path.exists(), f"{markdown.name} links {target}, which does not exist"


@pytest.mark.parametrize("markdown", _markdown_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_links_into_a_document_name_one_of_its_headings(markdown):
    for path, anchor in _links(markdown):
        target = (markdown.parent / path).resolve() if path else markdown
        if anchor and target.suffix == ".md" and target.exists():
            assert anchor in _anchors(target), f"{markdown.name} links {path}#{anchor}: {target.name} has no such heading"


def test_anchors_follow_the_rule_documents_are_read_with():
    assert anchor_of("Conversion speed") == "conversion-speed"
    assert anchor_of("The ceiling: a lookahead that is never wrong") == "the-ceiling-a-lookahead-that-is-never-wrong"
    assert anchor_of("`colibrictl top` (issue 19 §4)") == "colibrictl-top-issue-19-4"


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
    (`colibrid/thermal/`, `colibrid/system/memory.py`)."""
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
