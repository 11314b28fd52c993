"""What the repository says about itself holds: pyproject.toml's interpreter, the protocol
document's account of the server."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Standard-library modules newer than Python 3.10, with the version that brought them.
NEWER_STDLIB = {"tomllib": (3, 11)}


def _imported_modules() -> set[str]:
    names = set()
    for path in [*REPO.glob("colibrid/**/*.py"), *REPO.glob("colibrictl/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
    return names


def test_requires_python_covers_the_standard_library_we_import():
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires.startswith(">=")
    minimum = tuple(int(part) for part in requires[2:].split(".")[:2])

    for module in _imported_modules() & NEWER_STDLIB.keys():
        assert minimum >= NEWER_STDLIB[module], f"{module} needs Python {NEWER_STDLIB[module]}, pyproject says {requires}"


def test_the_protocol_document_knows_the_expert_cache():
    protocol = (REPO / "docs/protocol.md").read_text()

    assert "no expert cache" not in protocol
    assert "`cache` in `status`" in protocol
