#!/usr/bin/env bash
# The performance gate (benchmarks/README.md, "Performance gate"): the library's loads, open and
# save against references measured in the same run (memcpy, libzstd called directly, reading
# the footer, write(), safetensors), so that a several-fold slowdown fails CI on any machine.
# tests/run_all.sh runs it after ctest, alone, so that other tests do not disturb the timings.
#   tests/perf_gate.sh [BUILD_DIR]     (default: build)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BUILD="${1:-$ROOT/build}"
PY="${PYTHON:-python3}"
status=0
"$BUILD/tests/perf_gate" || status=1
# The Python check needs the shared library and safetensors (tests/install_deps.sh installs it).
if [ -f "$BUILD/src/libferry.so" ] && "$PY" -c "import numpy, safetensors" 2>/dev/null; then
  TENSORFERRY_LIBRARY="$BUILD/src/libferry.so" \
    PYTHONPATH="$ROOT/bindings/python${PYTHONPATH:+:$PYTHONPATH}" \
    "$PY" "$ROOT/tests/perf_gate_python.py" || status=1
else
  echo "perf gate (Python): skipped (no libferry.so or no safetensors)"
fi
exit "$status"
