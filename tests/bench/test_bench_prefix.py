"""bench/bench_prefix.py, a small run against colibrid on the demo pack: the second turn
reuses the first turn's prompt, the answers are those of a daemon without reuse."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_small_run_against_colibrid(demo_pack, tmp_path):
    out = tmp_path / "prefix.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "bench_prefix.py"), "--pack", str(demo_pack),
                           "--history-tokens", "80", "--question-tokens", "8", "--answer-tokens", "4",
                           "--conversations", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "median turn 2 / turn 1 with reuse" in proc.stdout and "load average" in proc.stdout
    result = json.loads(out.read_text())
    for reused, fresh in zip(result["reused"], result["fresh"]):
        first, second = reused["turn1"], reused["turn2"]
        assert first["cached_prompt_tokens"] == 0 and fresh["turn2"]["cached_prompt_tokens"] == 0
        assert first["prompt_tokens"] <= second["cached_prompt_tokens"] < second["prompt_tokens"]
        assert second["ttft_ms"] > 0 and first["ttft_ms"] > 0
    assert result["copies"]["bytes"] > 0 and result["copies"]["restore_ms"] >= 0
