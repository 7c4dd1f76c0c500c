#!/usr/bin/env bash
# PLANES encoding on a GPU host: the GPU decoder tests, then the benchmark (ratio, CPU and GPU
# decode speed, the host-to-device pipeline beside the pinned ceiling, and hot loads of an
# 8 GiB bf16 checkpoint when the loader benchmark is built).
#   tests/device/19_planes.sh BUILD_DIR OUT_DIR [MODEL.safetensors]
set -u
BUILD=${1:?usage: 19_planes.sh BUILD_DIR OUT_DIR [MODEL.safetensors]}
OUT=${2:?usage: 19_planes.sh BUILD_DIR OUT_DIR [MODEL.safetensors]}
MODEL=${3:-}
mkdir -p "$OUT"
find_bin() {  # a build folder (tests/, benchmarks/) or a flat folder of binaries
  for p in "$BUILD/$1" "$BUILD/$(basename "$1")"; do [ -x "$p" ] && { echo "$p"; return; }; done
}
status=0
GPU_TEST=$(find_bin tests/planes_gpu_test)
CPU_TEST=$(find_bin tests/planes_test)
BENCH=$(find_bin benchmarks/planes_bench)
FERRY=$(find_bin src/cli/ferry)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
for t in "$GPU_TEST" "$CPU_TEST"; do
  [ -n "$t" ] || continue
  timeout 120 "$t" > "$OUT/$(basename "$t").log" 2>&1 || status=1
done
if [ -n "$BENCH" ]; then
  args=()
  [ -n "$MODEL" ] && args+=("--minilm=$MODEL")
  timeout 200 "$BENCH" "${args[@]}" > "$OUT/planes_bench.log" 2>&1 || status=1
fi
# End to end: hot loads of an 8 GiB llama-like bf16 checkpoint in /dev/shm onto the GPU, in the
# PLANES encoding and raw, each beside the pinned host-to-device ceiling of the same run; then
# a one-shot load of the PLANES file in a fresh process.
if [ -n "$FERRY" ]; then
  SHM=/dev/shm/ferry-19-$$
  mkdir -p "$SHM"
  timeout 200 "$FERRY" bench --generate 8GiB --encoding planes --dir "$SHM" --keep --repeat 5 \
    > "$OUT/e2e_planes.log" 2>&1 || status=1
  kept=$(awk '/^kept/ {print $2}' "$OUT/e2e_planes.log")
  if [ -n "$kept" ]; then
    timeout 100 "$FERRY" bench "$kept" --repeat 1 > "$OUT/e2e_planes_fresh.log" 2>&1 || status=1
    rm -f "$kept"
  fi
  timeout 200 "$FERRY" bench --generate 8GiB --encoding raw --dir "$SHM" --repeat 5 \
    > "$OUT/e2e_raw.log" 2>&1 || status=1
  rm -rf "$SHM"
fi
echo "== 19_planes summary =="
cat "$OUT/gpu.txt"
for t in "$GPU_TEST" "$CPU_TEST"; do
  [ -n "$t" ] || continue
  printf '%-18s %s\n' "$(basename "$t")" "$(grep -E '^\[  (PASSED|FAILED)' "$OUT/$(basename "$t").log" | tr '\n' ' ')"
done
[ -n "$BENCH" ] && grep -E '^(ratio|cpu|gpu|link|pipe|load)' "$OUT/planes_bench.log"
for f in e2e_planes e2e_planes_fresh e2e_raw; do
  [ -f "$OUT/$f.log" ] || continue
  echo "-- $f"
  grep -E '^(checkpoint|warm-up|load|ceiling|ratio|ferry)' "$OUT/$f.log"
done
exit $status
