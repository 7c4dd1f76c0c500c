#!/usr/bin/env bash
# Saves from the GPU on the device machine: the GPU tests of the save pipeline, the NVML check
# (a process with device 1 current saving from device 1 leaves GPU 0 untouched), a two-rank
# NCCL sharded save then load (C++ and torch.distributed), the Python tests, and the benchmark
# table with its ceilings, then the peer comparison. About 4 minutes for 8 GiB.
#   tests/device/17_save.sh BUILD_DIR OUT_DIR [GIB]
set -u
BUILD="$(cd "$1" && pwd)"
OUT="$2"
GIB="${3:-8}"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
SCRATCH="$(mktemp -d /var/tmp/ferry_save.XXXXXX)"
trap 'rm -rf "$SCRATCH"' EXIT
export TENSORFERRY_LIBRARY="$BUILD/src/libferry.so"
export PYTHONPATH="$ROOT/bindings/python${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
declare -A RESULT

step() {  # name, log, command...
  local name="$1" log="$2"
  shift 2
  local t0=$SECONDS
  "$@" >"$OUT/$log" 2>&1
  local rc=$?
  case $rc in
    0) RESULT[$name]="pass" ;;
    77) RESULT[$name]="skipped" ;;
    *) RESULT[$name]="FAIL (rc $rc)" ;;
  esac
  echo "== $name: ${RESULT[$name]} ($((SECONDS - t0)) s, $log)"
  tail -n 3 "$OUT/$log"
}

nvidia-smi -L >"$OUT/gpus.txt" 2>&1
step "gtest save_test (device + host)" save_test.log \
  "$BUILD/tests/save_test" --gtest_filter='DeviceSaveTest.*:SaveTest.*:StagingPoolTest.*'
step "gtest sharded_test (ShardedSave)" sharded_test.log \
  "$BUILD/tests/sharded_test" --gtest_filter='ShardedSaveTest.*'
step "NVML: save on device 1 leaves GPU 0 untouched" nvml.log \
  "$BUILD/tests/save_check" nvml "$SCRATCH/nvml"
step "NCCL two-rank sharded save + load (C++)" sharded_cpp.log \
  "$BUILD/tests/save_check" sharded "$SCRATCH/sharded"
step "pytest test_save.py" pytest_save.log \
  python3 -m pytest -q -x "$ROOT/tests/python/test_save.py"
if [ "$NGPU" -ge 2 ]; then
  mkdir -p "$SCRATCH/pysharded"
  pysharded() {
    MASTER_ADDR=127.0.0.1 MASTER_PORT=29611 python3 "$ROOT/tests/python/save_sharded_check.py" \
      0 2 "$SCRATCH/pysharded" nccl &
    local p0=$!
    MASTER_ADDR=127.0.0.1 MASTER_PORT=29611 python3 "$ROOT/tests/python/save_sharded_check.py" \
      1 2 "$SCRATCH/pysharded" nccl
    local r1=$?
    wait $p0
    local r0=$?
    [ $r0 -eq 0 ] && [ $r1 -eq 0 ]
  }
  step "torch.distributed two-rank sharded save + load (NCCL)" sharded_py.log pysharded
else
  RESULT["torch.distributed two-rank sharded save + load (NCCL)"]="skipped (1 GPU)"
fi
step "save_bench (${GIB} GiB)" save_bench.log \
  "$BUILD/benchmarks/save_bench" --gib="$GIB" --disk-dir="$SCRATCH" --shm-dir=/dev/shm \
  --csv="$OUT/save_bench.csv"
step "save_compare (${GIB} GiB, python peers)" save_compare.log \
  python3 "$ROOT/benchmarks/compare/save_compare.py" --gib "$GIB" --dir "$SCRATCH" \
  --csv "$OUT/save_compare.csv"

echo
echo "==================== summary ===================="
for k in "${!RESULT[@]}"; do printf '%-58s %s\n' "$k" "${RESULT[$k]}"; done | sort
grep -h "NVML GPU" "$OUT/nvml.log" 2>/dev/null
echo
sed -n '/^path /,$p' "$OUT/save_bench.log"
echo
sed -n '/^saver /,$p' "$OUT/save_compare.log"
