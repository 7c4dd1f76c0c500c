#!/usr/bin/env bash
# Issue 25 on the GPU machine, from a built tree (torch and safetensors installed there):
#   tests/device/25_moe.sh BUILD_DIR OUT_DIR
# 0. the device tests of verification by default (loader_test, c_api_test, the torch tests of
#    many-tensor views and corrupt files);
# 1. MoE, Qwen3-30B-A3B's layout cut to 12 layers (4,719 tensors, 16.2 GB), C++ one-shot loads
#    in fresh processes (benchmarks/oneshot_bench --shape=moe) from /dev/shm and from the page
#    cache (/var/tmp, fsync'd then read once), beside the pinned ceiling of the same run:
#    the loader verified (the default) and not, and the variants that decide its defaults
#    (caller buffers from cudaMalloc / cudaMallocAsync, 8/12 workers, 6 and 8 MiB slots,
#    streaming); the first process after each file was written is its own row;
# 2. the same shape from Python in fresh interpreters (benchmarks/oneshot_python.py):
#    tensorferry.load_file verified and not, load_iter, safetensors on the same tensors;
#    the first process after Python wrote the file; then the page-cache copy;
# 3. the 8 GiB llama-like file (oneshot_bench's default shape): the default C++ Loader verified
#    and not, caller buffers, Python load_file verified and not;
# 4. steady state (`ferry bench`, warm loader, 5 loads each), verified against unverified in
#    the same run, alternating, on the 8 GiB file and the MoE file; the routes and worker
#    counts a verified load could take (ring vs registered page cache; 8/12/16 workers);
# 5. the whole model, 48 layers (18,867 tensors, 61.1 GB), from /dev/shm only, when tmpfs and
#    memory hold it (checked first; the page-cache copy would not fit the 64 GiB disk beside
#    it): C++ verified and not, first process after the write, Python verified and not.
# Full logs in OUT_DIR; a summary at the end. About 7 minutes on an H200 host (16 cores).
set -uo pipefail
BUILD="$(cd "${1:?BUILD_DIR}" && pwd)"
OUT="${2:?OUT_DIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
export TENSORFERRY_LIBRARY="$BUILD/src/libferry.so" FERRY_BUILD_DIR="$BUILD"
export PYTHONPATH="$ROOT/bindings/python" TENSORFERRY_SKIP_PIP_TEST=1
export LD_LIBRARY_PATH="$BUILD/src${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ONESHOT="$BUILD/benchmarks/oneshot_bench"
FERRY="$BUILD/src/cli/ferry"
PY="$ROOT/benchmarks/oneshot_python.py"
SHM=/dev/shm
DISK=/var/tmp
T0=$SECONDS

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
  df -h "$SHM" "$DISK"
  python3 -c "import torch, safetensors; print('torch', torch.__version__, 'safetensors', \
safetensors.__version__)" 2>&1
  grep -m1 "model name" /proc/cpuinfo
} > "$OUT/machine.txt" 2>&1

status=""
rc=0
step() {  # step NAME LOG CMD...: runs CMD (stdout and stderr in OUT/LOG), records its status
  local name="$1" log="$2" t=$SECONDS
  shift 2
  "$@" > "$OUT/$log" 2>&1
  local r=$?
  status="$status $name=$r($((SECONDS - t))s)"
  [ $r -ne 0 ] && rc=$r
  return 0
}
cleanup() {
  rm -f "$SHM"/ferry_moe_*.ferry "$SHM"/ferry_moe_py_* "$SHM"/ferry_oneshot.ferry \
    "$DISK"/ferry_moe_*.ferry "$DISK"/ferry_oneshot.ferry
}
trap cleanup EXIT
cleanup

# ---- 0. device tests ----------------------------------------------------------------------
mkdir -p "$OUT/scratch"
step loader_test loader_test.txt timeout 120 "$BUILD/tests/loader_test"
step c_api_test c_api_test.txt timeout 120 "$BUILD/tests/c_api_test" "$OUT/scratch"
step pytest_torch pytest_torch.txt timeout 180 python3 -m pytest -q -p no:cacheprovider \
  "$ROOT/tests/python/test_torch.py" -k "many_tensors or verify_by_default or load_iter"
rm -rf "$OUT/scratch"

# ---- 1. MoE 12 layers, C++ ----------------------------------------------------------------
step moe12_cpp moe12_cpp.txt timeout 300 "$ONESHOT" --shape=moe --layers=12 --reps=2 \
  --dirs="$SHM,$DISK" --first=loader:kind=loader --keep
rm -f "$SHM/ferry_moe_12.ferry"  # room for Python's own copy; the page-cache copy stays

# ---- 2. MoE 12 layers, Python -------------------------------------------------------------
step moe12_py_shm moe12_py_shm.txt timeout 300 python3 "$PY" --layers 12 --dir "$SHM" --reps 2
step moe12_py_disk moe12_py_disk.txt timeout 200 python3 "$PY" --reps 2 \
  --modes ferry,ferry_noverify,ferry_iter "$DISK/ferry_moe_12.ferry"

# ---- 3. the 8 GiB llama-like file ----------------------------------------------------------
step llama8_cpp llama8_cpp.txt timeout 200 "$ONESHOT" --gib=8 --reps=2 --dirs="$SHM" --no_host \
  --first=loader:kind=loader --keep \
  --cases="ceiling:kind=ceiling;loader:kind=loader;loader_noverify:kind=loader,verify=0;loader_one:kind=loader,alloc=one;loader_noverify_one:kind=loader,verify=0,alloc=one;loader_async_one:kind=loader,alloc=async_one"
step llama8_py llama8_py.txt timeout 120 python3 "$PY" --reps 2 --modes ferry,ferry_noverify \
  "$SHM/ferry_oneshot.ferry"

# ---- 4. steady state: verified against unverified, routes, workers -------------------------
bench() {  # bench LABEL FILE ARGS...: one `ferry bench`, its load and ratio lines kept
  local label="$1" file="$2"
  shift 2
  echo "== $label: ferry bench $(basename "$file") $*"
  timeout 60 "$FERRY" bench "$file" --repeat 5 "$@" 2>&1 | grep -E "^(load|ceiling|ratio|ferry:)"
}
{
  for round in 1 2; do
    bench "llama8 verified (round $round)" "$SHM/ferry_oneshot.ferry"
    bench "llama8 unverified (round $round)" "$SHM/ferry_oneshot.ferry" --no-verify
  done
  bench "llama8 verified, ring, 8 workers" "$SHM/ferry_oneshot.ferry" --path staging --threads 8
  bench "llama8 verified, ring, 16 workers" "$SHM/ferry_oneshot.ferry" --path staging --threads 16
  bench "llama8 verified, registered page cache" "$SHM/ferry_oneshot.ferry" --path register
  bench "llama8 unverified, registered page cache" "$SHM/ferry_oneshot.ferry" --path register \
    --no-verify
  bench "moe12 verified (page cache)" "$DISK/ferry_moe_12.ferry"
  bench "moe12 unverified (page cache)" "$DISK/ferry_moe_12.ferry" --no-verify
} > "$OUT/steady.txt" 2>&1
status="$status steady=done($((SECONDS - T0))s_total)"
cleanup

# ---- 5. the whole model, 48 layers, /dev/shm ---------------------------------------------
need_gib=60  # 61.1 GB = 56.9 GiB, plus room
shm_avail=$(df -BG --output=avail "$SHM" | tail -1 | tr -dc 0-9)
mem_avail=$(awk '/MemAvailable/ {print int($2 / 1048576)}' /proc/meminfo)
if [ $((SECONDS - T0)) -gt 330 ]; then
  echo "48 layers skipped: $((SECONDS - T0)) s used, the run would pass 8 minutes" > "$OUT/moe48.txt"
elif [ "$shm_avail" -lt "$need_gib" ] || [ "$mem_avail" -lt $((need_gib + 8)) ]; then
  echo "48 layers skipped: /dev/shm has ${shm_avail} GiB free, MemAvailable ${mem_avail} GiB;" \
    "the file needs ${need_gib} GiB of both (and 8 more of memory)" > "$OUT/moe48.txt"
else
  step moe48_cpp moe48_cpp.txt timeout 200 "$ONESHOT" --shape=moe --layers=48 --reps=2 \
    --dirs="$SHM" --no_host --first=loader:kind=loader \
    --cases="ceiling:kind=ceiling;loader:kind=loader;loader_noverify:kind=loader,verify=0"
  step moe48_py moe48_py.txt timeout 200 python3 "$PY" --layers 48 --dir "$SHM" --reps 1 \
    --modes ferry,ferry_noverify
  cat "$OUT/moe48_cpp.txt" "$OUT/moe48_py.txt" > "$OUT/moe48.txt" 2>/dev/null
fi

# ---- summary --------------------------------------------------------------------------------
rows() {  # the table header and the rows of interest of a oneshot_bench log
  grep -E "^(==|case|ceiling|loader|1st_after|host_|/)" "$1" | grep -v "^RESULT"
}
echo "== machine"; grep -E "model name|H200|MiB|thp|^torch" "$OUT/machine.txt"
echo "== device tests"
grep -hE "^\[  (PASSED|FAILED) |checks,|passed|failed" "$OUT/loader_test.txt" \
  "$OUT/c_api_test.txt" "$OUT/pytest_torch.txt" | tail -n 6
echo "== 1. MoE 12 layers, C++ fresh processes (GB/s from context; 'ceil': of the pinned ceiling)"
rows "$OUT/moe12_cpp.txt"
echo "== 2. MoE 12 layers, Python fresh interpreters"
grep -vE "^\s*$" "$OUT/moe12_py_shm.txt" | tail -n 12
grep -vE "^\s*$" "$OUT/moe12_py_disk.txt" | tail -n 6
echo "== 3. 8 GiB llama-like file"
rows "$OUT/llama8_cpp.txt"
tail -n 4 "$OUT/llama8_py.txt"
echo "== 4. steady state (ferry bench, 5 loads each)"
grep -E "^(==|load|ratio)" "$OUT/steady.txt" | sed -e 's/ (\([0-9.]* GiB per load\)/ (\1/'
echo "== 5. 48 layers"
grep -E "skipped|^(==|case|ceiling|loader|1st_after)|GB/s" "$OUT/moe48.txt" 2>/dev/null | head -n 16
echo "== exit status per step:$status (total $((SECONDS - T0)) s)"
exit $rc
