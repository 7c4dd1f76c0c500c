#!/usr/bin/env bash
# PyTorch checkpoint import (issue 18) on the GPU machine, from a built tree:
#   tests/device/18_torch_import.sh BUILD_DIR OUT_DIR
# 1. tests/data/torch/make_fixtures.py with the real torch into OUT_DIR/fixtures (commit that
#    folder as tests/data/torch/ to have CI check it);
# 2. the importer's Python tests against those fixtures (every dtype, views, pytorch_model.bin,
#    sharded index, DCP, TransformerEngine extra state of each version, legacy refusal), with
#    each tensor's SHA-256 compared to what torch computed;
# 3. ferry convert of the real pytorch_model.bin, then the bytes compared with torch.load's;
# 4. the TransformerEngine scenario: written on cuda:0, converted, loaded on cuda:1, NVML shows
#    nothing on GPU 0 (tests/python/te_import_scenario.py).
# Well under a minute.
set -uo pipefail
BUILD="$(cd "${1:?BUILD_DIR}" && pwd)"
OUT="${2:?OUT_DIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
export TENSORFERRY_LIBRARY="$BUILD/src/libferry.so" FERRY_BUILD_DIR="$BUILD"
export FERRY_BIN="$BUILD/src/cli/ferry" PYTHONPATH="$ROOT/bindings/python"
FIX="$OUT/fixtures"
rm -rf "$FIX" "$OUT/converted"
declare -A rc

python3 "$ROOT/tests/data/torch/make_fixtures.py" "$FIX" > "$OUT/make_fixtures.txt" 2>&1
rc[make_fixtures]=$?

FERRY_TORCH_FIXTURES="$FIX" timeout 300 python3 -m pytest -q -p no:cacheprovider \
  "$ROOT/tests/python/test_torch_import.py" > "$OUT/pytest.txt" 2>&1
rc[pytest_import]=$?

mkdir -p "$OUT/converted"
{
  "$FERRY_BIN" convert "$FIX/pytorch_model.bin" "$OUT/converted/model.ferry" && \
  "$FERRY_BIN" inspect "$FIX/te_cuda.pt" && \
  python3 - "$FIX/pytorch_model.bin" "$OUT/converted/model.ferry" <<'PY'
import sys, torch, tensorferry.torch as tft
ref = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
got = tft.load_state_dict(sys.argv[2], device="cpu")
assert sorted(ref) == sorted(got), (sorted(ref), sorted(got))
for k in ref:
    a, b = ref[k].contiguous(), got[k]
    assert a.dtype == b.dtype and a.shape == b.shape, k
    assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), k
print("pytorch_model.bin -> ferry: %d tensors bit-exact" % len(ref))
PY
} > "$OUT/bin_convert.txt" 2>&1
rc[bin_convert]=$?

timeout 300 python3 "$ROOT/tests/python/te_import_scenario.py" "$FIX" "$OUT/converted" \
  > "$OUT/te_scenario.txt" 2>&1
rc[te_scenario]=$?

for f in make_fixtures bin_convert te_scenario; do echo "== $f =="; cat "$OUT/$f.txt"; done
echo "== pytest (tail) =="; tail -n 25 "$OUT/pytest.txt"
echo "== summary =="
printf "%-16s %s\n" step "exit (0 pass; te_scenario 77: fewer than 2 GPUs)"
status=0
for k in make_fixtures pytest_import bin_convert te_scenario; do
  printf "%-16s %s\n" "$k" "${rc[$k]}"
  [ "${rc[$k]}" -ne 0 ] && status=1
done
exit $status
