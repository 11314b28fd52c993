"""The import graph of the product code: a directory is a layer, and imports only point down.

    tools · gateway · colibrictl                     entry points
    daemon                                           lifecycle, server, connections, engine loop, config
    engine · system · settings                       the model at work; what the daemon asks of the machine;
                                                     how a program reads its config
    models · pack · thermal · blockdev               descriptions and formats
    wire · native · sizes                            the protocol, the C library, byte sizes

Every import counts: at the top of a module, inside a function (imported late to save start-up
time) and under TYPE_CHECKING alike, since each is a dependency a reader has to follow.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("colibrid", "colibrictl")

# The rank of each layer: a module may import its own layer and the layers ranked below it.
RANKS = {
    "colibrid": 0,  # the package itself: its version, nothing else
    "colibrid.wire": 0, "colibrid.native": 0, "colibrid.sizes": 0,
    "colibrid.models": 1, "colibrid.thermal": 1, "colibrid.blockdev": 1,
    "colibrid.pack": 2,
    "colibrid.engine": 3, "colibrid.system": 3, "colibrid.settings": 3,
    "colibrid.daemon": 4,
    "colibrid.tools": 5, "colibrid.gateway": 5, "colibrictl": 5,
    "colibrid.__main__": 6,
}
# What each of these may import at all, beyond the standard library (and themselves).
ALLOWED_IMPORTS = {
    # colibrictl and the gateway speak to the daemon through wire; the client runs where
    # nothing else of the daemon's is installed.
    "colibrictl": {"colibrid", "colibrid.wire", "msgpack"},
    "colibrid.wire": {"colibrid", "msgpack"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def product_modules() -> dict[str, Path]:
    return {module_name(path): path for root in ROOTS for path in sorted((REPO / root).rglob("*.py"))}


def imported_names(name: str, path: Path) -> Iterator[str]:
    """Every module name ``name`` imports, absolute, with ``from X import y`` also giving X.y
    (y may be a submodule)."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            yield source
            yield from (f"{source}.{alias.name}" for alias in node.names)


def import_graph() -> dict[str, set[str]]:
    """module -> the product modules it imports (the nearest existing module of each name)."""
    modules = product_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for target in imported_names(name, path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target not in ROOTS:
                targets.add(target)
        graph[name] = targets
    return graph


def third_party_imports(name: str, path: Path) -> set[str]:
    tops = {target.split(".")[0] for target in imported_names(name, path) if target}
    return {top for top in tops if top not in sys.stdlib_module_names and top != "__future__"}


def layer_of(module: str) -> str:
    if module == "colibrid":
        return module
    for layer in sorted(RANKS, key=len, reverse=True):
        if layer == "colibrid":
            continue
        if module == layer or module.startswith(layer + "."):
            return layer
    raise AssertionError(f"{module} is in no layer: add its package to RANKS")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_product_module_is_in_a_layer():
    for name in product_modules():
        if name not in ROOTS:
            layer_of(name)


def test_no_module_imports_in_a_circle():
    assert cycles(import_graph()) == []


def test_no_package_imports_in_a_circle():
    packages: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        for target in targets:
            if module not in ROOTS and layer_of(module) != layer_of(target):
                packages.setdefault(layer_of(module), set()).add(layer_of(target))
    assert cycles(packages) == []


def upward_imports() -> set[str]:
    return {f"{module} -> {target}" for module, targets in import_graph().items() if module not in ROOTS
            for target in targets if RANKS[layer_of(target)] >= RANKS[layer_of(module)]
            and layer_of(target) != layer_of(module)}


def test_imports_only_point_down():
    assert sorted(upward_imports()) == []


def test_the_engine_never_imports_the_daemon_or_the_system_layer():
    # What the engine needs of the machine (hugepages, the memory budget) is handed in.
    reaches = {f"{module} -> {target}" for module, targets in import_graph().items()
               if layer_of(module) == "colibrid.engine" for target in targets
               if layer_of(target) in ("colibrid.daemon", "colibrid.system")}
    assert sorted(reaches) == []


@pytest.mark.parametrize("layer", sorted(ALLOWED_IMPORTS))
def test_the_client_and_the_protocol_import_only_what_they_may(layer):
    allowed = ALLOWED_IMPORTS[layer]
    modules = product_modules()
    strays = {}
    for name, path in modules.items():
        if name != layer and not name.startswith(layer + "."):
            continue
        product = {layer_of(target) for target in import_graph()[name]} - {layer}
        outside = (third_party_imports(name, path) - set(ROOTS)) | product
        if not outside <= allowed:
            strays[name] = sorted(outside - allowed)
    assert strays == {}


def test_the_native_layer_imports_nothing_above_it():
    above = sorted(f"{module} -> {target}" for module, targets in import_graph().items()
                   if layer_of(module) == "colibrid.native" for target in targets
                   if layer_of(target) != "colibrid.native")
    assert above == []


def test_the_graph_sees_late_and_type_only_imports(tmp_path, monkeypatch):
    # The checks above are only as good as the graph: an import inside a function or under
    # TYPE_CHECKING must count, or a cycle could hide there.
    package = tmp_path / "colibrid"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from colibrid import b\n")
    (package / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "ROOTS", ("colibrid",))
    assert import_graph() == {"colibrid": set(), "colibrid.a": {"colibrid.b"}, "colibrid.b": {"colibrid.a"}}
    assert cycles(import_graph()) == [["colibrid.a", "colibrid.b"]]


def test_only_the_native_layer_loads_libcolibri_and_ctypes_has_one_other_user():
    # docs/architecture.md says so: native/ turns C's statuses into exceptions in one place;
    # the thermal watch's SMART source needs ctypes only for the kernel's NVMe ioctl structure.
    users = sorted(name for name, path in product_modules().items()
                   if "ctypes" in {target.split(".")[0] for target in imported_names(name, path)}
                   and layer_of(name) != "colibrid.native")
    assert users == ["colibrid.thermal.smart_source"]


MAX_MODULE_LINES = 600


def test_no_product_module_is_over_600_lines():
    # A module a newcomer can read in one sitting; past this, it holds more than one concept.
    long = {name: lines for name, path in product_modules().items()
            if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}
