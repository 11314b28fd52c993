"""bench/ab_builds.py: two builds loaded side by side and swapped call by call inside one
engine, on the demo pack (the same build twice: both must run and be reported)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from colibrid.native import library

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("extra", [[], ["--batch", "3"], ["--prompt", "12"]])
def test_every_build_runs_inside_one_engine_and_is_reported(demo_pack, extra):
    build = str(library.library_path())
    out = subprocess.run([sys.executable, str(REPO / "bench" / "ab_builds.py"), "decode", str(demo_pack), build, build,
                          "--threads", "1", "--rounds", "3", *extra],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    medians = re.findall(r"(\d):\S+ ([0-9.]+) \[([0-9.]+), ([0-9.]+)\]", out)
    assert [m[0] for m in medians] == ["0", "1"], out
    for _, median, low, high in medians:
        assert 0 < float(low) <= float(median) <= float(high), out


def test_products_of_several_tokens_are_reported_per_token():
    build = str(library.library_path())
    out = subprocess.run([sys.executable, str(REPO / "bench" / "ab_builds.py"), "products", build, build, "--rows", "64",
                          "--tokens", "2,5", "--threads", "1", "--rounds", "3"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    lines = [line for line in out.splitlines() if "product" in line]
    assert [re.search(r"(\d+) tokens", line).group(1) for line in lines] == ["2", "5"], out
    assert all("us a token" in line and len(re.findall(r"\d:\S+ [0-9.]+ \[", line)) == 2 for line in lines), out


def test_products_can_take_a_fresh_copy_of_the_matrix_every_call():
    build = str(library.library_path())
    out = subprocess.run([sys.executable, str(REPO / "bench" / "ab_builds.py"), "products", build, build, "--rows", "64",
                          "--tokens", "8", "--threads", "1", "--rounds", "3", "--rotate-mb", "1"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    (line,) = [line for line in out.splitlines() if "product" in line]
    assert "7 copies in turn, 8 tokens" in line, out  # 1 MB of 64 x 2048 q8_0 matrices (139 kB each)


def test_attention_is_reported_per_shape_and_cache_type():
    build = str(library.library_path())
    out = subprocess.run([sys.executable, str(REPO / "bench" / "ab_builds.py"), "attention", build, build, "--context",
                          "50", "--rotate-mb", "2", "--threads", "1", "--rounds", "3"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    lines = [line for line in out.splitlines() if "keys" in line]
    assert [re.search(r"(\S+) cache", line).group(1) for line in lines] == ["f32", "f16"] * 2, out
    assert all("50 keys" in line and len(re.findall(r"\d:\S+ [0-9.]+ \[", line)) == 2 for line in lines), out


def test_one_build_is_refused(demo_pack):
    result = subprocess.run([sys.executable, str(REPO / "bench" / "ab_builds.py"), "decode", str(demo_pack),
                             str(library.library_path())], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "two builds or more" in result.stderr
