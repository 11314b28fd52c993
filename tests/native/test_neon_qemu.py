"""The NEON kernel level (libcolibri/src/simd_neon.c) against the portable level.

The build machines are x86-64, so libcolibri/tests/neon_check.c is cross-compiled with the
library sources for aarch64 and run under qemu-user (on an aarch64 host: the native compiler,
run directly). The C program states its tolerances, with the reasoning of
test_native_kernels.py's SIMD-vs-portable tests: NEON quantizes activations to int8, so it
equals the portable level within the activation-quantization bound, and the int8-activation
product computed in double within 1e-5 x scale. Correctness only: emulated speed means nothing.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

LIB = Path(__file__).resolve().parents[2] / "libcolibri"
SYSROOT = "/usr/aarch64-linux-gnu"  # libc6-dev-arm64-cross: the loader and libc qemu needs
PACKAGES = "gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user"
NATIVE = platform.machine() in ("aarch64", "arm64")


def _toolchain() -> tuple[str | None, list[str] | None]:
    """(compiler, command prefix that runs an aarch64 executable); None where missing."""
    if NATIVE:
        return shutil.which("cc"), []
    qemu = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
    return shutil.which("aarch64-linux-gnu-gcc"), [qemu, "-L", SYSROOT] if qemu else None


CC, RUN = _toolchain()


@pytest.mark.skipif(CC is None or RUN is None,
                    reason=f"needs aarch64-linux-gnu-gcc and qemu-aarch64 on PATH: apt-get install -y {PACKAGES}")
def test_neon_kernels_equal_the_portable_level(tmp_path):
    exe = tmp_path / "neon_check"
    sources = [LIB / "tests" / "neon_check.c", *sorted((LIB / "src").glob("*.c"))]
    # setup.py's flags (no -fvisibility=hidden: the library is linked into the program)
    build = subprocess.run([CC, "-O2", "-std=c11", "-ffp-contract=off", "-Wall", "-Wextra", f"-I{LIB / 'include'}",
                            *map(str, sources), "-lm", "-lpthread", "-o", str(exe)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([*RUN, str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "neon_check: PASS" in run.stdout, run.stdout + run.stderr
