#!/usr/bin/env bash
# Issue 23 on the GPU machine (torch installed there), from a built tree:
#   tests/device/23_defects.sh BUILD_DIR OUT_DIR
# 1. the torch tests this issue added or changed: save_state_dict of a nested state beside
#    `ferry convert` of the same torch.save file, CPU loads as views with verify= and
#    threads=, load_model(verify=True) on a corrupt file, safe_open(pt, cpu) views
#    (test_torch.py), and the sharded save over gloo, two generations (test_save.py);
# 2. the hostile-input suite with its deep FP8 descriptions (short ids: nothing huge in the
#    environment of the processes it starts);
# 3. benchmarks/host_load_python.py --torch: every Python host load of a 3 GiB llama-like file
#    in /dev/shm, TensorFerry beside safetensors in the same run (numpy and torch CPU). Each
#    TensorFerry row should be at or below 1.00x safetensors' time.
# A few minutes.
set -uo pipefail
BUILD="$(cd "${1:?BUILD_DIR}" && pwd)"
OUT="${2:?OUT_DIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
export TENSORFERRY_LIBRARY="$BUILD/src/libferry.so" FERRY_BUILD_DIR="$BUILD"
export PYTHONPATH="$ROOT/bindings/python" TENSORFERRY_SKIP_PIP_TEST=1
declare -A rc

python3 -c "import torch, safetensors, os; print('torch', torch.__version__, 'safetensors', \
safetensors.__version__, 'cpus', os.cpu_count())" > "$OUT/env.txt" 2>&1

timeout 600 python3 -m pytest -q -rs -p no:cacheprovider "$ROOT/tests/python/test_torch.py" \
  "$ROOT/tests/python/test_save.py" "$ROOT/tests/python/test_state.py" \
  "$ROOT/tests/python/test_host_loads.py" "$ROOT/tests/python/test_formats.py" \
  > "$OUT/torch_tests.txt" 2>&1
rc[torch_tests]=$?
timeout 600 python3 -m pytest -q -rs -p no:cacheprovider \
  "$ROOT/tests/python/test_hostile_inputs.py" > "$OUT/hostile.txt" 2>&1
rc[hostile]=$?
timeout 900 python3 "$ROOT/benchmarks/host_load_python.py" --gib 3 --reps 5 --torch \
  > "$OUT/host_load.txt" 2>&1
rc[host_load_bench]=$?

echo "== env =="; cat "$OUT/env.txt"
echo "== torch tests (tail) =="; tail -n 25 "$OUT/torch_tests.txt"
echo "== hostile inputs (tail) =="; tail -n 10 "$OUT/hostile.txt"
echo "== host loads beside safetensors =="; cat "$OUT/host_load.txt"
echo "== summary =="
status=0
for k in torch_tests hostile host_load_bench; do
  printf "%-16s %s\n" "$k" "${rc[$k]}"
  [ "${rc[$k]}" -eq 0 ] || status=1
done
exit $status
