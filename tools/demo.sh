#!/usr/bin/env bash
# The main job on a fresh machine: convert the default model (once, seconds), start colibrid
# on it, ask one question through colibrictl, stop the daemon.
#   tools/demo.sh [NAME]   NAME: a model shipped under models/ (default colibri-olmoe-stdlib;
#                          colibri-olmoe64-stdlib is the 64-expert one)
#   COLIBRI_MODEL    checkpoint directory to convert instead (any Hugging Face MoE checkpoint)
#   COLIBRI_PACK     where its pack goes (default ~/.cache/colibri/<model name>.pack)
#   COLIBRI_PROMPT   what to ask (default "def fibonacci(n):")
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
name=${1:-colibri-olmoe-stdlib}
if [ -z "${COLIBRI_MODEL:-}" ] && [ ! -f "$here/models/$name/config.json" ]; then
    echo "demo: no model named '$name'; shipped models:" $(cd "$here/models" && ls -d */ | tr -d /) >&2
    exit 2
fi
model=${COLIBRI_MODEL:-$here/models/$name}
pack=${COLIBRI_PACK:-$HOME/.cache/colibri/$(basename "$model").pack}
prompt=${COLIBRI_PROMPT:-"def fibonacci(n):"}
rundir=$(mktemp -d)
sock=$rundir/colibrid.sock

# Convert on first use, and again whenever the checkpoint is newer than the pack.
if [ ! -f "$pack/manifest.json" ] || [ -n "$(find "$model" -newer "$pack/manifest.json" -name '*.safetensors')" ]; then
    mkdir -p "$(dirname "$pack")"
    colibri-convert "$model" "$pack" --force
fi

# The daemon's log goes to a file, so that it does not cut into the answer; it is shown if the
# daemon fails, and its line about the request (tokens, tokens/s) after the answer.
log=$rundir/colibrid.log
colibrid --model "$pack" --socket "$sock" 2>"$log" &
daemon=$!
stop_daemon() { kill "$daemon" 2>/dev/null || true; wait "$daemon" 2>/dev/null || true; }
trap 'stop_daemon; rm -rf "$rundir"' EXIT

# The daemon binds its socket only once the pack is loaded.
for _ in $(seq 300); do
    [ -S "$sock" ] && break
    kill -0 "$daemon" 2>/dev/null || { cat "$log" >&2; echo "demo: colibrid exited during startup" >&2; exit 1; }
    sleep 0.1
done

printf '%s' "$prompt"  # the answer continues it
colibrictl --socket "$sock" ask --raw --max-tokens 96 "$prompt" && status=0 || status=$?
echo
stop_daemon
grep -h "request .* from " "$log" >&2 || cat "$log" >&2  # what it cost, or why it failed
exit "$status"
