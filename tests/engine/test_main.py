"""`python -m colibrid.engine PACK PROMPT`: a pack run without the daemon, as from a shell."""

from __future__ import annotations

import subprocess
import sys


def test_the_answer_ends_its_line(demo_pack):
    """The shell's prompt (or the next line of a file) must not run on after the answer; the
    statistics go to stderr, on their own line."""
    result = subprocess.run([sys.executable, "-m", "colibrid.engine", str(demo_pack), "def fibonacci(n):",
                             "--raw", "--max-tokens", "8", "--temperature", "0"],
                            capture_output=True, text=True, timeout=120)

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), "the demo model should have said something"
    assert result.stdout.endswith("\n")
    assert result.stderr.startswith("[length: ")
