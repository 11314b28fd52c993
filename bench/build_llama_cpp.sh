#!/bin/sh
# Builds llama.cpp's llama-bench from the llama-cpp-python source distribution (its vendored
# tree), for side-by-side benchmarks. Idempotent: does nothing if the binary exists.
#   bench/build_llama_cpp.sh            -> $LLAMA_CPP_DIR/build/bin/llama-bench
# LLAMA_CPP_DIR defaults to ~/.cache/colibri-bench/llama.cpp.
set -eu
ROOT="${LLAMA_CPP_DIR:-$HOME/.cache/colibri-bench/llama.cpp}"
BIN="$ROOT/build/bin/llama-bench"
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
mkdir -p "$ROOT"
SDIST_DIR="$ROOT/sdist"
if ! ls "$SDIST_DIR"/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
    pip download llama-cpp-python --no-deps --no-binary :all: -d "$SDIST_DIR" -q
fi
SDIST=$(ls "$SDIST_DIR"/llama_cpp_python-*.tar.gz | head -n 1)
tar -xzf "$SDIST" -C "$ROOT"
SRC=$(ls -d "$ROOT"/llama_cpp_python-*/vendor/llama.cpp | head -n 1)
# GGML_NATIVE=ON: llama.cpp at its best on this machine (what its users get from a local build).
cmake -S "$SRC" -B "$ROOT/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF >&2
cmake --build "$ROOT/build" --target llama-bench -j "$(nproc)" >&2
echo "$BIN"
