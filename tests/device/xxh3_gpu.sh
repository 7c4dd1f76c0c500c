#!/usr/bin/env bash
# Block checksums hashed on a GPU: the device tests (against libxxhash, corrupt blocks flagged,
# PLANES blocks hashed after their decode), the host tests of the same code, the device tests
# again under compute-sanitizer memcheck where the toolkit has it (no read outside a block),
# then the benchmark beside the copy and read ceilings of the same run.
#   tests/device/xxh3_gpu.sh BUILD_DIR OUT_DIR
set -u
BUILD=${1:?usage: xxh3_gpu.sh BUILD_DIR OUT_DIR}
OUT=${2:?usage: xxh3_gpu.sh BUILD_DIR OUT_DIR}
mkdir -p "$OUT"
find_bin() {  # a build folder (tests/, benchmarks/) or a flat folder of binaries
  for p in "$BUILD/$1" "$BUILD/$(basename "$1")"; do [ -x "$p" ] && { echo "$p"; return; }; done
}
status=0
GPU_TEST=$(find_bin tests/checksum_gpu_test)
CPU_TEST=$(find_bin tests/xxh3_device_test)
BENCH=$(find_bin benchmarks/checksum_bench)
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv \
  > "$OUT/gpu.txt" 2>&1
for t in "$GPU_TEST" "$CPU_TEST"; do
  [ -n "$t" ] || { echo "missing test binary" >> "$OUT/missing.txt"; status=1; continue; }
  timeout 300 "$t" > "$OUT/$(basename "$t").log" 2>&1 || status=1
done
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
if [ -n "$GPU_TEST" ] && [ -n "$SANITIZER" ]; then
  # The 1 GiB case is slow under memcheck and adds nothing the edge cases do not cover.
  timeout 500 "$SANITIZER" --tool memcheck --error-exitcode 3 "$GPU_TEST" \
    --gtest_filter='-*OneGibibyte*' > "$OUT/memcheck.log" 2>&1 || status=1
fi
if [ -n "$BENCH" ]; then
  timeout 500 "$BENCH" --benchmark_out="$OUT/checksum_bench.json" --benchmark_out_format=json \
    > "$OUT/checksum_bench.log" 2>&1 || status=1
else
  echo "missing benchmarks/checksum_bench" >> "$OUT/missing.txt"
  status=1
fi
echo "== xxh3_gpu summary =="
cat "$OUT/gpu.txt"
for t in "$GPU_TEST" "$CPU_TEST"; do
  [ -n "$t" ] || continue
  printf '%-20s %s\n' "$(basename "$t")" \
    "$(grep -E '^\[  (PASSED|FAILED|SKIPPED) +\] [0-9]+ test' "$OUT/$(basename "$t").log" \
      | tr '\n' ' ')"
done
if [ -f "$OUT/memcheck.log" ]; then
  printf '%-20s %s\n' memcheck "$(grep -E 'ERROR SUMMARY|^\[  (PASSED|FAILED) +\] [0-9]+ test' "$OUT/memcheck.log" \
    | tr '\n' ' ')"
else
  echo "memcheck             not run (no compute-sanitizer on this machine)"
fi
[ -f "$OUT/checksum_bench.log" ] && grep -E '^BM_' "$OUT/checksum_bench.log"
[ -f "$OUT/missing.txt" ] && cat "$OUT/missing.txt"
exit $status
