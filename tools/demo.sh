#!/usr/bin/env bash
# The main job on a fresh machine: convert the default model (once, seconds), start colibrid
# on it, ask one question through colibrictl, stop the daemon.
#   COLIBRI_MODEL    checkpoint to convert (default: models/colibri-olmoe-stdlib, shipped here)
#   COLIBRI_PACK     where its pack goes (default ~/.cache/colibri/<model name>.pack)
#   COLIBRI_PROMPT   what to ask (default "def fibonacci(n):")
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
model=${COLIBRI_MODEL:-$here/models/colibri-olmoe-stdlib}
pack=${COLIBRI_PACK:-$HOME/.cache/colibri/$(basename "$model").pack}
prompt=${COLIBRI_PROMPT:-"def fibonacci(n):"}
rundir=$(mktemp -d)
sock=$rundir/colibrid.sock

# Convert on first use, and again whenever the checkpoint is newer than the pack.
if [ ! -f "$pack/manifest.json" ] || [ -n "$(find "$model" -newer "$pack/manifest.json" -name '*.safetensors')" ]; then
    mkdir -p "$(dirname "$pack")"
    colibri-convert "$model" "$pack" --force
fi

colibrid --model "$pack" --socket "$sock" &
daemon=$!
trap 'kill "$daemon" 2>/dev/null; wait "$daemon" 2>/dev/null; rm -rf "$rundir"' EXIT

# The daemon binds its socket only once the pack is loaded.
for _ in $(seq 300); do
    [ -S "$sock" ] && break
    kill -0 "$daemon" 2>/dev/null || { echo "demo: colibrid exited during startup" >&2; exit 1; }
    sleep 0.1
done

printf '%s' "$prompt"  # the answer continues it
colibrictl --socket "$sock" ask --raw --max-tokens 96 "$prompt"
