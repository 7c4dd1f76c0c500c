#!/usr/bin/env bash
# Same speed before and after the layers refactoring: two built trees (OLD, NEW) measured in
# one run on the GPU machine, alternating, on the same files:
#   1. steady hot load: `ferry bench FILE --repeat 5` of one 8 GiB raw file in /dev/shm
#      (ring reused), OLD NEW OLD NEW;
#   2. fresh-process load: oneshot_bench's pinned ceiling and the library's loader (default
#      and one-allocation), each in a new process, OLD NEW;
#   3. save: save_bench (device -> ext4 and /dev/shm, raw and shuffle+zstd), OLD NEW.
#   tests/device/22_layers.sh OLD_BUILD NEW_BUILD OUT_DIR [GIB]
set -uo pipefail
OLD="$(cd "${1:?OLD_BUILD}" && pwd)"
NEW="$(cd "${2:?NEW_BUILD}" && pwd)"
OUT="${3:?OUT_DIR}"
GIB="${4:-8}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
SHM="$(mktemp -d /dev/shm/ferry22.XXXXXX)"
trap 'rm -rf "$SHM" /dev/shm/ferry_oneshot.ferry' EXIT

{
  date -u
  nproc
  nvidia-smi --query-gpu=index,name,driver_version --format=csv 2>&1
  echo "old: $OLD"
  echo "new: $NEW"
} > "$OUT/machine.txt"

summary=()
# 1. Steady hot load of one file.
timeout 200 "$NEW/src/cli/ferry" bench --generate "${GIB}GiB" --dir "$SHM" --keep --repeat 1 \
  > "$OUT/generate.txt" 2>&1
FILE=$(awk '/^kept/ {print $2}' "$OUT/generate.txt")
if [ -n "$FILE" ] && [ -f "$FILE" ]; then
  for b in old new old new; do
    B=$OLD
    [ $b = new ] && B=$NEW
    timeout 120 "$B/src/cli/ferry" bench "$FILE" --repeat 5 > "$OUT/bench_$b.txt" 2>&1
    summary+=("hot $b: $(grep -E '^load ' "$OUT/bench_$b.txt" | head -1) | $(grep -E '^ceiling ' \
      "$OUT/bench_$b.txt" | head -1)")
  done
  rm -f "$FILE"
else
  summary+=("hot: generation failed (see generate.txt)")
fi

# 2. Fresh-process loads.
CASES='ceiling:kind=ceiling;loader:kind=loader;loader_one:kind=loader,alloc=one'
for b in old new; do
  B=$OLD
  [ $b = new ] && B=$NEW
  timeout 280 "$B/benchmarks/oneshot_bench" --gib="$GIB" --reps=3 --dirs=/dev/shm --no_host \
    --cases="$CASES" > "$OUT/oneshot_$b.txt" 2> "$OUT/oneshot_$b.stderr"
  summary+=("fresh $b (rc $?):")
  while IFS= read -r line; do summary+=("  $line"); done < <(grep -E '^ *(ceiling|loader)' \
    "$OUT/oneshot_$b.txt")
done

# 3. Saves from the device.
for b in old new; do
  B=$OLD
  [ $b = new ] && B=$NEW
  timeout 200 "$B/benchmarks/save_bench" --gib=4 --disk-dir=/var/tmp --shm-dir="$SHM" \
    > "$OUT/save_$b.txt" 2>&1
  summary+=("save $b (rc $?):")
  while IFS= read -r line; do summary+=("  $line"); done < <(grep -E 'GB/s' "$OUT/save_$b.txt" |
    head -n 12)
done

echo "== summary =="
printf '%s\n' "${summary[@]}"
