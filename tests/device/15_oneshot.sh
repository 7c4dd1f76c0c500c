#!/usr/bin/env bash
# One-shot loads in fresh processes (issue 15), run on the GPU machine from a built tree:
#   tests/device/15_oneshot.sh BUILD_DIR OUT_DIR
# Writes an 8 GiB checkpoint to /dev/shm and /var/tmp (page cache), runs benchmarks/oneshot_bench
# (every candidate in a fresh process, beside the pinned ceiling of the same run), then Python
# load_file(device="cuda") in fresh interpreters on the same files; then the many-tensor
# benchmarks (Python beside safetensors, C++ open + index) and the C and Python tests that
# exercise the packed loads on the device. About 5 minutes.
set -uo pipefail
BUILD="$(cd "${1:?BUILD_DIR}" && pwd)"
OUT="${2:?OUT_DIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
GIB="${FERRY_ONESHOT_GIB:-8}"

{
  date -u
  uname -r
  nproc
  free -g
  nvidia-smi --query-gpu=index,name,driver_version,pcie.link.gen.current,pcie.link.width.current \
    --format=csv 2>&1
  for f in enabled shmem_enabled defrag; do
    echo "thp $f: $(cat /sys/kernel/mm/transparent_hugepage/$f 2>&1)"
  done
  mount | grep -E ' on (/dev/shm|/|/var/tmp) ' || true
  df -h /dev/shm /var/tmp
} > "$OUT/machine.txt" 2>&1

rc=0
status=""
step() {  # step NAME CMD...: runs CMD, records its exit status
  local name="$1"
  shift
  "$@"
  local r=$?
  status="$status $name=$r"
  [ $r -ne 0 ] && rc=$r
  return 0
}
step oneshot_bench timeout 300 "$BUILD/benchmarks/oneshot_bench" --gib="$GIB" --reps=2 \
  --dirs=/dev/shm,/var/tmp --keep > "$OUT/oneshot.txt" 2> "$OUT/oneshot.stderr"

if python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  files=()
  for d in /dev/shm /var/tmp; do
    [ -f "$d/ferry_oneshot.ferry" ] && files+=("$d/ferry_oneshot.ferry")
  done
  if [ ${#files[@]} -gt 0 ]; then
    TENSORFERRY_LIBRARY="$BUILD/src/libferry.so" PYTHONPATH="$ROOT/bindings/python" \
      step oneshot_python timeout 120 python3 "$ROOT/benchmarks/oneshot_python.py" --reps 2 \
      "${files[@]}" > "$OUT/python.txt" 2>&1
  fi
fi
rm -f /dev/shm/ferry_oneshot.ferry /var/tmp/ferry_oneshot.ferry

# Many tensors: Python open + keys() and load_file beside safetensors; C++ open + index.
export TENSORFERRY_LIBRARY="$BUILD/src/libferry.so" PYTHONPATH="$ROOT/bindings/python"
step many_tensors timeout 150 python3 "$ROOT/benchmarks/many_tensors.py" --reps 5 \
  > "$OUT/many_tensors.txt" 2>&1
step format_bench timeout 90 "$BUILD/benchmarks/format_bench" --benchmark_filter=OpenIndex \
  --ferry_mib=16 --benchmark_repetitions=5 --benchmark_report_aggregates_only=true \
  > "$OUT/open_index.txt" 2>&1
# The packed C and Python paths on the device.
mkdir -p "$OUT/scratch"
LD_LIBRARY_PATH="$BUILD/src${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" step c_api_test \
  "$BUILD/tests/c_api_test" "$OUT/scratch" > "$OUT/c_api_test.txt" 2>&1
# The loader's device tests (streaming order on a caller's stream among them).
step loader_test timeout 120 "$BUILD/tests/loader_test" > "$OUT/loader_test.txt" 2>&1
FERRY_BUILD_DIR="$BUILD" step pytest timeout 240 python3 -m pytest -q -p no:cacheprovider \
  "$ROOT/tests/python/test_torch.py" "$ROOT/tests/python/test_numpy.py" > "$OUT/pytest.txt" 2>&1

echo "== machine =="; cat "$OUT/machine.txt"
echo "== oneshot_bench =="; cat "$OUT/oneshot.txt"
[ -s "$OUT/oneshot.stderr" ] && { echo "== stderr (tail) =="; tail -n 20 "$OUT/oneshot.stderr"; }
[ -f "$OUT/python.txt" ] && { echo "== python one-shot =="; cat "$OUT/python.txt"; }
echo "== many tensors (Python) =="; cat "$OUT/many_tensors.txt"
echo "== C++ open + index, 100,000 tensors =="; grep -E "OpenIndex|CPUs" "$OUT/open_index.txt"
echo "== c_api_test =="; tail -n 3 "$OUT/c_api_test.txt"
echo "== loader_test =="; grep -E "^\[  (PASSED|FAILED|SKIPPED) " "$OUT/loader_test.txt"
echo "== pytest (torch, numpy) =="; tail -n 5 "$OUT/pytest.txt"
echo "== exit status per step:$status"
exit $rc
