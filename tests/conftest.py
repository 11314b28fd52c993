"""Shared fixtures: tiny checkpoints and their packs, built once per test session."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


class PackFactory:
    """Builds (and caches) tiny checkpoints and converted packs under one temp dir."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._checkpoints: dict = {}
        self._packs: dict = {}

    def checkpoint(self, spec) -> Path:
        from tests.tiny_checkpoints import build_checkpoint

        if spec.name not in self._checkpoints:
            self._checkpoints[spec.name] = build_checkpoint(spec, self.root / "ckpt" / spec.name)
        return self._checkpoints[spec.name]

    def pack(self, spec, quant: str = "f32") -> Path:
        from colibrid.tools.convert.converter import convert
        from colibrid.tools.convert.quant_spec import parse_quant

        key = (spec.name, quant)
        if key not in self._packs:
            out = self.root / "packs" / f"{spec.name}-{quant.replace(',', '_').replace('=', '-')}"
            convert(self.checkpoint(spec), out, parse_quant(quant), progress=False)
            self._packs[key] = out
        return self._packs[key]


@pytest.fixture(scope="session")
def packs(tmp_path_factory) -> PackFactory:
    pytest.importorskip("transformers")
    return PackFactory(tmp_path_factory.mktemp("colibri"))


@pytest.fixture(scope="session")
def demo_pack(tmp_path_factory) -> Path:
    """A random-weight OLMoE pack (numpy only, ~1 s; 4 MoE layers of 16 experts, ~4 ms a
    token): for the daemon and the thermal watch, which need no transformers."""
    out = tmp_path_factory.mktemp("demo-pack") / "demo.pack"
    subprocess.run([sys.executable, "-m", "colibrid.tools.demo", str(out), "--force"], check=True,
                   capture_output=True, timeout=120)
    return out


@pytest.fixture
def kernel_level():
    """native.set_kernels, with the active kernel level restored after the test."""
    from colibrid import native

    before = native.kernels()
    yield native.set_kernels
    native.set_kernels(before)


@pytest.fixture(scope="session")
def pools():
    """libcolibri worker pools of 1, 2 and 3 threads, by size: results must not depend on the split."""
    from colibrid import native

    made = {n: native.ThreadPool(n) for n in (1, 2, 3)}
    yield made
    for pool in made.values():
        pool.close()
