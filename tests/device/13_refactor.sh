#!/usr/bin/env bash
# Same speed before and after a refactoring (issue 13): runs, from one built tree, the loader's
# GPU tests, the seed scenario (two GPUs) and `ferry bench --generate 8GiB`, and prints one
# summary line per step. Run it once per build (old and new) in the same session and compare.
#   tests/device/13_refactor.sh BUILD_DIR OUT_DIR
# About 3 minutes per build on an H200 host.
set -uo pipefail
BUILD="$(cd "${1:?usage: 13_refactor.sh BUILD_DIR OUT_DIR}" && pwd)"
OUT="${2:?usage: 13_refactor.sh BUILD_DIR OUT_DIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
SCRATCH="$(mktemp -d "${TMPDIR:-/var/tmp}/ferry13.XXXXXX")"
trap 'rm -rf "$SCRATCH"' EXIT

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }

{
  date -u
  git -C "$(dirname "$0")" rev-parse HEAD 2>/dev/null || true
  echo "build: $BUILD"
  nvidia-smi --query-gpu=index,name,driver_version --format=csv 2>&1
} > "$OUT/machine.txt" 2>&1

summary=()

# 1. loader_test: every test with its time; the total is the figure to compare.
t0=$(now)
timeout 300 "$BUILD/tests/loader_test" --gtest_color=no > "$OUT/loader_test.txt" 2>&1
rc=$?
total_ms=$(sed -n 's/.*tests* ran\. (\([0-9]*\) ms total).*/\1/p' "$OUT/loader_test.txt" | tail -1)
passed=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) test.*/\1/p' "$OUT/loader_test.txt")
skipped=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) test.*/\1/p' "$OUT/loader_test.txt")
summary+=("loader_test      rc=$rc passed=${passed:-0} skipped=${skipped:-0} gtest_total=${total_ms:-?} ms wall=$(since "$t0") s")

# 2. The seed scenario: write on device 0, load on device 1 in a fresh process, three times
#    at 2 GiB (the load time is a one-shot load), once at the default size.
for mib in 64 2048 2048 2048; do
  t0=$(now)
  timeout 120 "$BUILD/tests/seed_scenario" all "$SCRATCH" "$mib" >> "$OUT/seed_scenario.txt" 2>&1
  rc=$?
  load=$(sed -n 's/^loader pid [0-9]*: .* MiB in \([0-9.]*\) s onto.*/\1/p' "$OUT/seed_scenario.txt" |
    tail -1)
  verdict=$(grep -E 'SEED SCENARIO (PASS|FAIL)|skipped' "$OUT/seed_scenario.txt" | tail -1)
  summary+=("seed_scenario    ${mib} MiB rc=$rc load=${load:-?} s wall=$(since "$t0") s: $verdict")
done

# 3. ferry bench: an 8 GiB generated checkpoint, hot page cache, five timed loads.
t0=$(now)
timeout 300 "$BUILD/src/cli/ferry" bench --generate 8GiB --dir "$SCRATCH" --repeat 5 \
  > "$OUT/bench.txt" 2>&1
rc=$?
load=$(grep -E '^load ' "$OUT/bench.txt" | head -1)
warm=$(grep -E '^warm-up ' "$OUT/bench.txt" | head -1)
ceiling=$(grep -E '^ceiling ' "$OUT/bench.txt" | head -1)
summary+=("ferry bench 8GiB rc=$rc wall=$(since "$t0") s")
summary+=("  $warm")
summary+=("  $load")
summary+=("  $ceiling")

echo "== machine =="
cat "$OUT/machine.txt"
echo "== loader_test (tail) =="
tail -n 5 "$OUT/loader_test.txt"
echo "== bench =="
tr "\r" "\n" < "$OUT/bench.txt" | grep -v "^ *$" | tail -n 20
echo "== summary: $BUILD =="
printf '%s\n' "${summary[@]}"
