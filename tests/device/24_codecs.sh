#!/usr/bin/env bash
# Compressed loads at the codec's pace (issue 24, item 1) on a GPU host, every figure beside
# ceilings measured in the same run:
#   1. hot loads (files in /dev/shm) of shuffle+zstd and zstd bf16 checkpoints onto the GPU,
#      with 2 loader threads (also confined to 2 cores with taskset) and with the default
#      threads; `ferry bench` prints the pinned host-to-device ceiling and, for zstd-coded
#      files, the codec's own decode rate of the same blocks (N threads, and N x one thread);
#      the same files loaded into host memory; two knobs the host-path measurements point at
#      (more staging slots than decode workers; 1 MiB slots over 4 MiB blocks);
#   2. cold loads from a disk-backed folder (cold_bench: page cache dropped, needs root) with
#      2 workers on 2 cores and with 16, beside the O_DIRECT read rate of the same files;
#   3. the CI performance gate (CPU only) on this host's cores.
#   tests/device/24_codecs.sh BUILD_DIR OUT_DIR [DISK_DIR=/var/tmp] [SIZE=4GiB]
# Logs under OUT_DIR; a summary at the end. About 10 minutes.
set -uo pipefail
BUILD="$(cd "${1:?usage: 24_codecs.sh BUILD_DIR OUT_DIR [DISK_DIR] [SIZE]}" && pwd)"
OUT="${2:?usage: 24_codecs.sh BUILD_DIR OUT_DIR [DISK_DIR] [SIZE]}"
DISK="${3:-/var/tmp}"
SIZE="${4:-4GiB}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
find_bin() {  # a build folder (tests/, benchmarks/) or a flat folder of binaries
  for p in "$BUILD/$1" "$BUILD/$(basename "$1")"; do [ -x "$p" ] && { echo "$p"; return; }; done
}
FERRY=$(find_bin src/cli/ferry)
COLD=$(find_bin benchmarks/cold_bench)
GATE=$(find_bin tests/perf_gate)
status=0
{
  date -u
  nproc
  free -g
  nvidia-smi --query-gpu=index,name,driver_version --format=csv 2>&1
} > "$OUT/machine.txt" 2>&1

# bench NAME ARGS...: one `ferry bench` run, its log in OUT/NAME.log.
bench() {
  local name=$1
  shift
  timeout 300 "$@" > "$OUT/$name.log" 2>&1 || { echo "$name: exit $?" >> "$OUT/errors.txt"; status=1; }
}

if [ -n "$FERRY" ]; then
  SHM=/dev/shm/ferry-24-$$
  mkdir -p "$SHM"
  for enc in shuffle+zstd zstd; do
    tag=${enc/+/_}
    bench "hot_${tag}_default" "$FERRY" bench --generate "$SIZE" --encoding "$enc" --dir "$SHM" \
      --keep --repeat 5
    file=$(awk '/^kept/ {print $2}' "$OUT/hot_${tag}_default.log")
    [ -n "$file" ] || continue
    bench "hot_${tag}_t2" "$FERRY" bench "$file" --threads 2 --repeat 5
    bench "hot_${tag}_t2_taskset" taskset -c 0,1 "$FERRY" bench "$file" --threads 2 --repeat 5
    bench "hot_${tag}_t16" "$FERRY" bench "$file" --threads 16 --repeat 5
    # Host memory as the target (what the CI gate measures), 2 threads and default.
    bench "host_${tag}_t2" env CUDA_VISIBLE_DEVICES= "$FERRY" bench "$file" --threads 2 --repeat 5
    bench "host_${tag}_default" env CUDA_VISIBLE_DEVICES= "$FERRY" bench "$file" --repeat 5
    if [ "$enc" = shuffle+zstd ]; then
      # 64 MiB of staging holds 15 slots of 4 MiB: fewer than 16 decode workers.
      bench "hot_${tag}_staging128" "$FERRY" bench "$file" --staging-mib 128 --repeat 5
      # Device loads still cut blocks at slots: each 1 MiB slot decodes its whole 4 MiB block.
      bench "hot_${tag}_slot1" "$FERRY" bench "$file" --slot-mib 1 --repeat 5
    fi
    rm -f "$file"
  done
  bench hot_raw_default "$FERRY" bench --generate "$SIZE" --encoding raw --dir "$SHM" --repeat 5
  rm -rf "$SHM"
fi

if [ -n "$COLD" ]; then
  gib=$(echo "$SIZE" | sed -E 's/GiB$//')
  # All cores: every row (raw and shuffle+zstd, 8 and 16 workers); then 2 cores, 2 workers.
  timeout 900 "$COLD" --ferry_gib="$gib" --ferry_dir="$DISK" > "$OUT/cold_all_cores.log" 2>&1 ||
    status=1
  timeout 900 taskset -c 0,1 "$COLD" --ferry_gib="$gib" --ferry_dir="$DISK" \
    --benchmark_filter='BM_RawRead|threads:2/' > "$OUT/cold_2_cores.log" 2>&1 || status=1
fi

[ -n "$GATE" ] && { timeout 300 "$GATE" > "$OUT/perf_gate.log" 2>&1 || status=1; }

echo "== 24_codecs summary ($(date -u +%F), $(nproc) CPUs) =="
cat "$OUT/machine.txt"
for f in "$OUT"/hot_*.log "$OUT"/host_*.log; do
  [ -f "$f" ] || continue
  echo "-- $(basename "$f" .log)"
  grep -E '^(loader|load|ceiling|decode|ratio)' "$f"
done
for f in cold_all_cores cold_2_cores; do
  [ -f "$OUT/$f.log" ] || continue
  echo "-- $f (GBps: uncompressed bytes; raw_equiv_GBps of BM_RawRead: the O_DIRECT read rate x the file's ratio)"
  grep -E '^BM_' "$OUT/$f.log"
done
[ -f "$OUT/perf_gate.log" ] && { echo "-- perf_gate"; cat "$OUT/perf_gate.log"; }
[ -f "$OUT/errors.txt" ] && { echo "-- errors"; cat "$OUT/errors.txt"; }
exit $status
