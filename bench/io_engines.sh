#!/bin/sh
# io_engines.sh — build bench/io_engines.c and run it (issue #4: io_uring vs pread threads for the
# expert loader). All arguments go to the program; see the header of io_engines.c.
#   bench/io_engines.sh --verify 300 --record-bytes 128K ~/.cache/colibri-bench/olmoe-q8_0.pack/experts.bin
#   bench/io_engines.sh --repeat 2 ~/.cache/colibri-bench/olmoe-q8_0.pack/experts.bin      # the pack's records
#   bench/io_engines.sh --repeat 2 --record-bytes 1M ~/.cache/colibri-bench/olmoe-q8_0.pack/experts.bin
# The binary goes to $IO_ENGINES_BIN (default: /tmp/io_engines-UID).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
bin=${IO_ENGINES_BIN:-/tmp/io_engines-$(id -u)}
${CC:-cc} -O2 -std=c11 -Wall -Wextra -pthread "$here/io_engines.c" -o "$bin"
exec "$bin" "$@"
