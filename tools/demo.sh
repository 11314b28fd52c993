#!/usr/bin/env bash
# The main job on a fresh machine: build the default pack (once), start colibrid on it,
# ask one question through colibrictl, stop the daemon.
#   COLIBRI_DEMO_PACK  where the pack lives (default ~/.cache/colibri/demo.pack)
#   COLIBRI_PROMPT     what to ask (default "def fibonacci(n):")
set -euo pipefail
pack=${COLIBRI_DEMO_PACK:-$HOME/.cache/colibri/demo.pack}
prompt=${COLIBRI_PROMPT:-"def fibonacci(n):"}
rundir=$(mktemp -d)
sock=$rundir/colibrid.sock

if [ ! -f "$pack/manifest.json" ]; then
    mkdir -p "$(dirname "$pack")"
    python -m colibrid.demo "$pack" --force
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

printf '%s' "$prompt" | colibrictl --socket "$sock" ask --raw --max-tokens 48
