"""What colibri-convert tells its user when it is done."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
DEFAULT_MODEL = REPO / "models" / "colibri-olmoe-stdlib"


def test_the_summary_counts_layers_and_experts_per_layer(tmp_path):
    """16 experts in each of 4 layers is said as such, not as '64 experts' (64 is the number of
    expert records, which reads like a model with 64 experts)."""
    config = json.loads((DEFAULT_MODEL / "config.json").read_text())
    layers, experts = config["num_hidden_layers"], config["num_experts"]

    result = subprocess.run([sys.executable, "-m", "colibrid.tools.convert.cli", str(DEFAULT_MODEL),
                             str(tmp_path / "out.pack")], capture_output=True, text=True, timeout=120)

    assert result.returncode == 0, result.stderr
    assert f"olmoe, {layers} layers of {experts} experts, dense " in result.stderr
    assert f"{layers * experts} experts" not in result.stderr
