#!/usr/bin/env bash
# The main job on a fresh machine: install dependencies, build, write a sample checkpoint, load
# it (onto the current GPU when one is usable, into host memory otherwise) and print the load
# throughput beside the hardware ceiling measured in the same run.
#   benchmarks/run_main.sh [SIZE]      (default 2GiB)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BUILD="${BUILD_DIR:-$ROOT/build}"
SIZE="${1:-2GiB}"
bash "$ROOT/tests/install_deps.sh"
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD" -j "$(nproc)"
FERRY="$BUILD/src/cli/ferry"
if [ -x "$FERRY" ]; then
  exec "$FERRY" bench --generate "$SIZE"
fi
GIB=$(python3 -c "import re,sys; s=sys.argv[1]; m=re.match(r'([0-9.]+)\s*([KMG]i?B)?$', s); \
v=float(m.group(1)); u=(m.group(2) or 'GiB')[0]; print(v/{'K':1<<20,'M':1<<10,'G':1}[u])" "$SIZE")
exec "$BUILD/benchmarks/load_bench" --ferry_gib="$GIB" --benchmark_filter='BM_PinnedCeiling|BM_Load/path:1/threads:8/chunkMiB:4/prealloc:0|BM_HostLoad/threads:8|BM_HostMemcpy'
