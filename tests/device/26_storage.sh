#!/usr/bin/env bash
# Loads from object storage and HTTP onto the GPU (issue 26, item 7), beside the parallel
# range-GET ceiling of the same run: benchmarks/remote_bench.py with --device, raw,
# shuffle+zstd and planes files, loopback and a limited link.
#   tests/device/26_storage.sh BUILD_DIR OUT_DIR [MIB=512] [LIMIT_MBIT=1600]
# The GPU host has no package manager and no network: what is missing there (moto, nginx, tc,
# peers) is named in OUT/missing.txt and left out; HTTP falls back to the Python range server of
# tests/servers/servers.py when nginx is absent. Peer packages built elsewhere may travel in
# BUILD_DIR/peers (pip install --target): they are put on the path when present.
# About 2-3 minutes on an H200 host (the whole script stays within 240 s).
set -uo pipefail
usage="usage: 26_storage.sh BUILD_DIR OUT_DIR [MIB] [LIMIT_MBIT]"
BUILD="$(cd "${1:?$usage}" && pwd)"
OUT="${2:?$usage}"
MIB="${3:-512}"
LIMIT="${4:-1600}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
HERE="$(cd "$(dirname "$0")/../.." && pwd)"
END=$((SECONDS + 230))
status=0
{
  date -u
  nproc
  free -g | head -2
  nvidia-smi --query-gpu=name,driver_version --format=csv 2>&1
} > "$OUT/machine.txt" 2>&1

# What this host has, and what the benchmark falls back to without it.
: > "$OUT/missing.txt"
have_py() { python3 -c "import $1" 2>/dev/null; }
have_py moto || echo "moto: not installed; no s3:// rows" >> "$OUT/missing.txt"
have_py boto3 || echo "boto3: not installed; no s3:// rows, no boto3 peer" >> "$OUT/missing.txt"
command -v nginx > /dev/null || [ -x /usr/sbin/nginx ] ||
  echo "nginx: not installed; HTTP served by the Python range server" >> "$OUT/missing.txt"
command -v curl > /dev/null || echo "curl: not installed; no ceiling, no run" >> "$OUT/missing.txt"
command -v tc > /dev/null || echo "tc: not installed; no limited-link rows" >> "$OUT/missing.txt"
have_py ml_dtypes || have_py torch ||
  echo "ml_dtypes and torch: neither installed; no bf16 checkpoint can be made" >> "$OUT/missing.txt"
PEERS=""
[ -d "$BUILD/peers" ] && PEERS="$BUILD/peers"
PYTHONPATH="$PEERS" python3 -c "import runai_model_streamer" 2>/dev/null ||
  echo "runai-model-streamer: not importable (peer row left out)" >> "$OUT/missing.txt"
cat "$OUT/missing.txt"

BIN="$BUILD/benchmarks/remote_load"
[ -x "$BIN" ] || BIN="$BUILD/remote_load"
if [ ! -x "$BIN" ] || ! command -v curl > /dev/null; then
  echo "26_storage: remote_load or curl missing; nothing run" | tee -a "$OUT/errors.txt"
  exit 1
fi
BUILD_ARG="$BUILD"
if [ ! -x "$BUILD/benchmarks/remote_load" ]; then  # a flat folder of binaries
  mkdir -p "$OUT/build/benchmarks" "$OUT/build/src"
  ln -sf "$BIN" "$OUT/build/benchmarks/remote_load"
  for lib in "$BUILD"/libferry.so* "$BUILD"/src/libferry.so*; do
    [ -e "$lib" ] && ln -sf "$lib" "$OUT/build/src/$(basename "$lib")"
  done
  BUILD_ARG="$OUT/build"
fi

# One run on the device; if it overruns, the host run is skipped rather than the whole budget.
run() {
  local name=$1
  shift
  local left=$((END - SECONDS))
  if [ "$left" -lt 20 ]; then
    echo "$name: skipped, $left s left" | tee -a "$OUT/errors.txt"
    return
  fi
  timeout --kill-after=5 "$left" python3 "$HERE/benchmarks/remote_bench.py" --build "$BUILD_ARG" \
    --peers-path "$PEERS" --json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2> "$OUT/$name.err" ||
    { echo "$name: exit $?" >> "$OUT/errors.txt"; status=1; }
}
run device --device --mib "$MIB" --reps 2 --limit-mbit "$LIMIT"
run host --mib "$MIB" --reps 1 --limit-mbit 0

echo "== summary (tensor MB/s and its ratio to the ceiling of the same run)"
for f in device host; do
  [ -f "$OUT/$f.log" ] && { echo "-- $f"; cat "$OUT/$f.log"; }
done
[ -s "$OUT/errors.txt" ] && { echo "-- errors"; cat "$OUT/errors.txt"; tail -n 5 "$OUT"/*.err; }
exit $status
