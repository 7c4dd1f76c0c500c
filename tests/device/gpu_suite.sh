#!/usr/bin/env bash
# The whole test suite on a GPU machine, from a built tree copied there (ctest's absolute paths
# do not travel, so each test program is run directly): every gtest program, the C API test,
# the seed scenario, the NVML save check, the distributed check, then pytest with CUDA.
#   tests/device/gpu_suite.sh BUILD_DIR OUT_DIR
# Exits non-zero when any step failed; one line per step on stdout, logs in OUT_DIR.
set -u
BUILD="$(cd "${1:?BUILD_DIR}" && pwd)"
OUT="${2:?OUT_DIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
export TENSORFERRY_LIBRARY="$BUILD/src/libferry.so" FERRY_BUILD_DIR="$BUILD"
export PYTHONPATH="$ROOT/bindings/python${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TENSORFERRY_SKIP_PIP_TEST=1
export LD_LIBRARY_PATH="$BUILD/src${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
SCRATCH="$(mktemp -d /var/tmp/ferry_suite.XXXXXX)"
trap 'rm -rf "$SCRATCH"' EXIT
rc=0

step() {  # NAME LOG CMD...
  local name="$1" log="$2" t0=$SECONDS
  shift 2
  (cd "$SCRATCH" && "$@") >"$OUT/$log" 2>&1
  local r=$?
  [ $r -ne 0 ] && [ $r -ne 77 ] && rc=1
  printf '%-28s rc=%-3s %4s s  %s\n' "$name" "$r" "$((SECONDS - t0))" \
    "$(grep -aE '^\[  (PASSED|FAILED) |passed|failed' "$OUT/$log" | tail -n 1)"
}

nvidia-smi -L
for t in "$BUILD"/tests/*_test; do
  n="$(basename "$t")"
  case "$n" in
    c_api_test) step "$n" "$n.log" timeout 300 "$t" "$SCRATCH" ;;
    *) step "$n" "$n.log" timeout 300 "$t" ;;
  esac
done
[ -x "$BUILD/tests/seed_scenario" ] &&
  step seed_scenario seed_scenario.log timeout 300 "$BUILD/tests/seed_scenario" all "$SCRATCH"
[ -x "$BUILD/tests/save_check" ] &&
  step save_check_nvml save_check.log timeout 300 "$BUILD/tests/save_check" nvml "$SCRATCH/sc"
[ -x "$BUILD/tests/distributed_bench" ] &&
  step distributed_check distributed_check.log timeout 300 "$BUILD/tests/distributed_bench" check \
    "$SCRATCH"
step pytest pytest.log timeout 500 python3 -m pytest -q -p no:cacheprovider "$ROOT/tests/python"
grep -aE "^(FAILED|ERROR)" "$OUT/pytest.log" | head -n 20
exit $rc
