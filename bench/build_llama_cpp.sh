#!/bin/sh
# Builds llama.cpp's llama-bench (and llama-server, llama-completion on request) from the
# llama-cpp-python source distribution (its vendored tree), for side-by-side benchmarks.
# Idempotent: does nothing if the binaries exist.
#   bench/build_llama_cpp.sh            -> $LLAMA_CPP_DIR/build/bin/llama-bench
#   LLAMA_CPP_ISA=avx2 bench/build_llama_cpp.sh -> $LLAMA_CPP_DIR/build-avx2/bin/llama-bench
# Settings (environment):
#   LLAMA_CPP_DIR             default ~/.cache/colibri-bench/llama.cpp
#   LLAMA_CPP_ISA             native (default): GGML_NATIVE=ON, llama.cpp at its best on this
#                             machine (what its users get from a local build); avx2: AVX2, FMA,
#                             F16C and no AVX-512, the peer of COLIBRI_KERNELS=avx2, in build-avx2/
#   LLAMA_CPP_PYTHON_VERSION  pin the llama-cpp-python sdist (e.g. 0.3.36); default: the newest
#   LLAMA_CPP_TARGETS         default "llama-bench"; add llama-completion for greedy checks,
#                             llama-server for bench/bench_serving.py (built without its web UI:
#                             no npm, nothing downloaded; the HTTP API is all the bench uses)
# Prints the llama-bench path on its last line.
set -eu
ROOT="${LLAMA_CPP_DIR:-$HOME/.cache/colibri-bench/llama.cpp}"
ISA="${LLAMA_CPP_ISA:-native}"
TARGETS="${LLAMA_CPP_TARGETS:-llama-bench}"
case "$ISA" in
    native) BUILD="$ROOT/build"
            ISA_FLAGS="-DGGML_NATIVE=ON" ;;
    avx2)   BUILD="$ROOT/build-avx2"
            ISA_FLAGS="-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON \
                       -DGGML_F16C=ON -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF \
                       -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF" ;;
    *) echo "LLAMA_CPP_ISA must be native or avx2, not $ISA" >&2; exit 2 ;;
esac
missing=""
for target in $TARGETS; do
    [ -x "$BUILD/bin/$target" ] || missing="$missing $target"
done
if [ -z "$missing" ]; then echo "$BUILD/bin/llama-bench"; exit 0; fi

mkdir -p "$ROOT"
SDIST_DIR="$ROOT/sdist"
if [ -n "${LLAMA_CPP_PYTHON_VERSION:-}" ]; then
    PATTERN="llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
    REQUIREMENT="llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
else
    PATTERN="llama_cpp_python-*.tar.gz"
    REQUIREMENT="llama-cpp-python"
fi
# shellcheck disable=SC2086
if ! ls "$SDIST_DIR"/$PATTERN >/dev/null 2>&1; then
    pip download "$REQUIREMENT" --no-deps --no-binary :all: -d "$SDIST_DIR" -q >&2
fi
# shellcheck disable=SC2086
SDIST=$(ls "$SDIST_DIR"/$PATTERN | sort -V | tail -n 1)
SRC="$ROOT/$(basename "$SDIST" .tar.gz)/vendor/llama.cpp"
[ -d "$SRC" ] || tar -xzf "$SDIST" -C "$ROOT"
# shellcheck disable=SC2086
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release $ISA_FLAGS -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
      -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >&2
# shellcheck disable=SC2086
cmake --build "$BUILD" --target $missing -j "$(nproc)" >&2
echo "$BUILD/bin/llama-bench"
