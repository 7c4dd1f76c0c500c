#!/usr/bin/env bash
# Builds TensorFerry and runs every test: the GoogleTest suites and C tests through ctest, the
# performance gate (tests/perf_gate.sh), then the Python tests. GPU tests skip themselves when
# no CUDA device is usable.
#   tests/run_all.sh [BUILD_DIR]     (default: build)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BUILD="${1:-$ROOT/build}"
PY="${PYTHON:-python3}"
bash "$ROOT/tests/install_deps.sh"
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$BUILD" -j "$(nproc)"
(cd "$BUILD" && ctest --output-on-failure -j "$(nproc)")
# Speed against references measured in the same run; alone, after the tests.
bash "$ROOT/tests/perf_gate.sh" "$BUILD"
if [ -d "$ROOT/tests/python" ] && ls "$ROOT"/tests/python/test_*.py >/dev/null 2>&1; then
  export TENSORFERRY_LIBRARY="$BUILD/src/libferry.so"
  export FERRY_BUILD_DIR="$BUILD"
  export PYTHONPATH="$ROOT/bindings/python${PYTHONPATH:+:$PYTHONPATH}"
  "$PY" -m pytest -q "$ROOT/tests/python"
fi
