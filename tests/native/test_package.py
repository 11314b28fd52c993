"""colibrid.native is a package of modules by concept, used as one namespace: every
``native.<name>`` the repository writes resolves, and every submodule's public name is
re-exported, so a binding added to a module is native.<name> at once."""

import importlib
import pkgutil
import re
from pathlib import Path

from colibrid import native

REPO = Path(__file__).resolve().parents[2]


def test_every_native_name_used_in_the_repository_exists():
    used = set()
    for folder in ("colibrid", "colibrictl", "tests", "bench", "tools"):
        for path in (REPO / folder).rglob("*.py"):
            if path.parent.name != "native":
                used.update(re.findall(r"\bnative\.([A-Za-z_]\w*)", path.read_text()))
    used.discard("py")  # "native.py" in prose
    assert len(used) > 40, used  # the scan found the callers
    assert sorted(name for name in used if not hasattr(native, name)) == []


def test_every_public_name_of_every_module_is_re_exported():
    modules = [importlib.import_module(f"colibrid.native.{info.name}") for info in pkgutil.iter_modules(native.__path__)]
    assert len(modules) >= 8
    for module in modules:
        for name, value in vars(module).items():
            if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__:
                assert getattr(native, name) is value, f"{module.__name__}.{name}"


def test_no_module_is_named_like_a_name_it_exports():
    # importing colibrid.native.<m> sets native.<m> to the module: a function of that name
    # (native.kernels(), the active level) would be replaced by it, or replace it
    names = [info.name for info in pkgutil.iter_modules(native.__path__)]
    for module_name in names:
        module = importlib.import_module(f"colibrid.native.{module_name}")
        exported = {n for m in names for n in vars(importlib.import_module(f"colibrid.native.{m}"))}
        assert module_name not in exported, module_name
        assert getattr(native, module_name) is module
