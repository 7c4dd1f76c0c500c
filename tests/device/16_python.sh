#!/usr/bin/env bash
# Python package on the GPU machine (issue 16), from a built tree (no pip: no internet there):
#   tests/device/16_python.sh BUILD_DIR OUT_DIR
# 1. DLPack consumers torch, cupy, jax on CUDA, plus the CPU ones (tests/python/test_dlpack.py);
# 2. safetensors parity with torch, CPU and CUDA (test_parity.py), and the torch and numpy
#    suites (test_torch.py, test_numpy.py);
# 3. tensorferry.torch.load_model into a real torch.nn.Module on cuda:1 with current device 1;
#    NVML must show this process on GPU 1 and not on GPU 0 (tests/python/load_model_scenario.py).
# Under a minute.
set -uo pipefail
BUILD="$(cd "${1:?BUILD_DIR}" && pwd)"
OUT="${2:?OUT_DIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
export TENSORFERRY_LIBRARY="$BUILD/src/libferry.so" FERRY_BUILD_DIR="$BUILD"
export PYTHONPATH="$ROOT/bindings/python" TENSORFERRY_SKIP_PIP_TEST=1
declare -A rc

python3 -c "import torch, cupy, jax, safetensors, pynvml; print('torch', torch.__version__, \
'cuda devices', torch.cuda.device_count(), 'jax', jax.__version__, jax.devices())" \
  > "$OUT/env.txt" 2>&1

timeout 300 python3 -m pytest -v -p no:cacheprovider "$ROOT/tests/python/test_dlpack.py" \
  > "$OUT/dlpack.txt" 2>&1
rc[dlpack]=$?
timeout 300 python3 -m pytest -q -rs -p no:cacheprovider "$ROOT/tests/python/test_parity.py" \
  "$ROOT/tests/python/test_torch.py" "$ROOT/tests/python/test_numpy.py" > "$OUT/suites.txt" 2>&1
rc[parity_torch_numpy]=$?
timeout 300 python3 "$ROOT/tests/python/load_model_scenario.py" "$OUT/scenario" \
  > "$OUT/load_model.txt" 2>&1
rc[load_model_cuda1]=$?
rm -rf "$OUT/scenario"

echo "== env =="; cat "$OUT/env.txt"
echo "== DLPack consumers =="; grep -E "PASSED|FAILED|SKIPPED|ERROR" "$OUT/dlpack.txt"
tail -n 30 "$OUT/dlpack.txt" | grep -v PASSED
echo "== parity, torch, numpy (tail) =="; tail -n 25 "$OUT/suites.txt"
echo "== load_model on cuda:1 =="; cat "$OUT/load_model.txt"
echo "== summary =="
printf "%-20s %s\n" step "exit (0 pass; load_model_cuda1 77: fewer than 2 GPUs)"
status=0
for k in dlpack parity_torch_numpy load_model_cuda1; do
  printf "%-20s %s\n" "$k" "${rc[$k]}"
  [ "${rc[$k]}" -eq 0 ] || status=1
done
exit $status
