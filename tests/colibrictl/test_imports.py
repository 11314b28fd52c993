"""The client's promise: msgpack, the standard library and the protocol (colibrid.wire), nothing
else. It must run where the daemon's dependencies (numpy, the C library, tokenizers) are not
installed."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.colibrictl.conftest import REPO_ROOT, cli_env

# Snapshots of the non-stdlib modules: at start, after `import msgpack`, after importing the
# CLI. Site hooks (an editable install's finder, _distutils_hack) are loaded before anything of
# ours, and msgpack's compiled extension registers Cython runtime modules (cython_runtime,
# _cython_3_x); so what the CLI may add is exactly colibrictl.*, the colibrid package itself
# (its __init__ only reads the version) and colibrid.wire.*, plus what msgpack itself adds.
_PROBE = """
import json, sys
def third_party():
    return sorted(m for m in sys.modules if m.split('.')[0] not in sys.stdlib_module_names)
start = third_party()
import msgpack
with_msgpack = third_party()
import colibrictl.cli, colibrictl.chat, colibrictl.conversation
print(json.dumps({"start": start, "with_msgpack": with_msgpack, "with_cli": third_party()}))
"""


def test_the_cli_imports_only_msgpack_the_standard_library_and_the_protocol():
    # A fresh interpreter: this test process has imported numpy and colibrid long ago.
    result = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                            env=cli_env(), cwd=REPO_ROOT, timeout=30)
    assert result.returncode == 0, result.stderr
    snapshot = {name: set(modules) for name, modules in json.loads(result.stdout).items()}

    added_by_msgpack = snapshot["with_msgpack"] - snapshot["start"]
    added_by_cli = snapshot["with_cli"] - snapshot["with_msgpack"]
    assert {m.split(".")[0] for m in added_by_cli} == {"colibrictl", "colibrid"}, sorted(added_by_cli)
    assert {m for m in added_by_msgpack if not m.startswith("msgpack")} <= {
        m for m in added_by_msgpack if m == "cython_runtime" or m.startswith("_cython_")
    }
    colibrid_modules = {m for m in snapshot["with_cli"] if m.split(".")[0] == "colibrid"}
    assert colibrid_modules - {"colibrid", "colibrid.wire"} == {
        m for m in colibrid_modules if m.startswith("colibrid.wire.")}, sorted(colibrid_modules)
    assert "colibrid.wire.client" in colibrid_modules  # it does speak through wire
    assert not {m for m in snapshot["with_cli"] if m.split(".")[0] == "numpy"}
