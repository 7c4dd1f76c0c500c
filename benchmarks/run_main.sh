#!/usr/bin/env bash
# The main job on a fresh machine: install dependencies, build, write a sample checkpoint, load it
# (onto the current GPU when one is usable, into host memory otherwise) and print the load
# throughput beside the hardware ceiling measured in the same run.
#   benchmarks/run_main.sh [SIZE]      (default 2GiB)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BUILD="${BUILD_DIR:-$ROOT/build}"
SIZE="${1:-2GiB}"
bash "$ROOT/tests/install_deps.sh"
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD" -j "$(nproc)" --target ferry_cli
exec "$BUILD/src/cli/ferry" bench --generate "$SIZE"
