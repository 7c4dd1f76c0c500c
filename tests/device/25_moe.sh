#!/usr/bin/env bash
# Issue 25 on the GPU machine, from a built tree, in at most about 240 s:
#   tests/device/25_moe.sh BUILD_DIR OUT_DIR
# Every load runs in a fresh process (CUDA context excluded from the clock), beside the pinned
# ceiling of the same run:
# 1. MoE, Qwen3-30B-A3B's layout cut to 12 layers (4,719 tensors, 16.2 GB), C++
#    (benchmarks/oneshot_bench --shape=moe) from /dev/shm and from the page cache (/var/tmp,
#    fsync'd then read once): the default Loader verified and unverified, caller buffers from
#    one cudaMalloc; the first process after each file was written is its own row;
# 2. the same file from Python (benchmarks/oneshot_python.py): load_file verified and
#    verify=False;
# 3. the 160-tensor 8 GiB llama-like file: the default C++ Loader verified and unverified and
#    with one caller allocation, Python verified and unverified; then `ferry bench` (warm
#    loader, 5 loads) verified against unverified, alternating;
# 4. peers: a 4-layer MoE cut (1,583 tensors, 5.5 GB) written by Python as .ferry and, by
#    safetensors itself, as .safetensors: the first process after the write, tensorferry
#    verified and not, safetensors.torch.load_file;
# 5. FERRY_MOE48=1 only (61 GB, minutes): the whole model from /dev/shm when it fits.
# A step starts only while the time budget (FERRY_BUDGET_S, default 230) lasts; each is cut at
# what is left. Full logs in OUT_DIR; the summary lines start with "25:".
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
SHM=${FERRY_SHM_DIR:-/dev/shm}
DISK=${FERRY_DISK_DIR:-/var/tmp}
BUDGET=${FERRY_BUDGET_S:-230}
# Smaller cuts for a dry run of the script itself (the issue's figures need the defaults).
LAYERS=${FERRY_MOE_LAYERS:-12}
GIB=${FERRY_LLAMA_GIB:-8}
PEER_LAYERS=${FERRY_PEER_LAYERS:-4}
T0=$SECONDS

{
  date -u
  nproc
  free -g
  nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current \
    --format=csv,noheader 2>&1
  python3 -c "import torch, safetensors; print('torch', torch.__version__, 'safetensors', \
safetensors.__version__)" 2>&1
  grep -m1 "model name" /proc/cpuinfo
} > "$OUT/machine.txt" 2>&1

status=""
rc=0
step() {  # step NAME LOG CAP CMD...: CMD (output in OUT/LOG) for at most CAP s and the budget
  local name="$1" log="$2" cap="$3" t=$SECONDS
  shift 3
  local left=$((BUDGET - (SECONDS - T0)))
  if [ "$left" -lt 15 ]; then
    status="$status $name=skipped"
    echo "skipped: the time budget is spent" > "$OUT/$log"
    return 0
  fi
  [ "$cap" -gt "$left" ] && cap=$left
  timeout "$cap" "$@" > "$OUT/$log" 2>&1
  local r=$?
  status="$status $name=$r($((SECONDS - t))s)"
  [ $r -ne 0 ] && rc=$r
  return 0
}
cleanup() {
  rm -f "$SHM"/ferry_moe_*.ferry "$SHM"/ferry_moe_py_* "$SHM"/ferry_oneshot.ferry \
    "$DISK"/ferry_moe_*.ferry
}
trap cleanup EXIT
cleanup

LOADER_CASES="ceiling:kind=ceiling;loader:kind=loader;loader_noverify:kind=loader,verify=0"
LOADER_CASES="$LOADER_CASES;loader_one:kind=loader,alloc=one"
# What the default's one allocation should come from: cudaMallocAsync (the default), cudaMalloc.
LOADER_CASES="$LOADER_CASES;loader_arena_malloc:kind=loader,arena_malloc=1"

# ---- 1. MoE 12 layers, C++ ----------------------------------------------------------------
step moe12_cpp moe12_cpp.txt 110 "$ONESHOT" --shape=moe --layers="$LAYERS" --reps=2 --no_host \
  --dirs="$SHM,$DISK" --first=loader:kind=loader --keep --cases="$LOADER_CASES"
rm -f "$DISK/ferry_moe_$LAYERS.ferry"

# ---- 2. MoE 12 layers, Python ------------------------------------------------------------
step moe12_py moe12_py.txt 40 python3 "$PY" --reps 2 --modes ferry,ferry_noverify \
  "$SHM/ferry_moe_$LAYERS.ferry"
rm -f "$SHM/ferry_moe_$LAYERS.ferry"

# ---- 3. the 160-tensor 8 GiB file ---------------------------------------------------------
step llama8_cpp llama8_cpp.txt 40 "$ONESHOT" --gib="$GIB" --reps=2 --dirs="$SHM" --no_host \
  --first=loader:kind=loader --keep --cases="$LOADER_CASES"
step llama8_py llama8_py.txt 30 python3 "$PY" --reps 2 --modes ferry,ferry_noverify \
  "$SHM/ferry_oneshot.ferry"
bench() {  # bench LABEL ARGS...: one `ferry bench` of the 8 GiB file, its load lines kept
  local label="$1"
  shift
  echo "== $label"
  "$FERRY" bench "$SHM/ferry_oneshot.ferry" --repeat 5 "$@" 2>&1 | grep -E "^(load |ferry:)"
}
steady() {
  bench verified
  bench unverified --no-verify
  bench "verified (again)"
  bench "unverified (again)" --no-verify
}
export FERRY SHM
step steady steady.txt 25 bash -c "$(declare -f bench steady); steady"
rm -f "$SHM/ferry_oneshot.ferry"

# ---- 4. peers: a 4-layer cut written by Python, with its safetensors twin ---------------
step peers_py peers_py.txt 60 python3 "$PY" --layers "$PEER_LAYERS" --dir "$SHM" --reps 1 \
  --modes ferry,ferry_noverify,safetensors

# ---- 5. the whole model, 48 layers (FERRY_MOE48=1) -----------------------------------------
if [ "${FERRY_MOE48:-0}" = 1 ]; then
  shm_avail=$(df -BG --output=avail "$SHM" | tail -1 | tr -dc 0-9)
  mem_avail=$(awk '/MemAvailable/ {print int($2 / 1048576)}' /proc/meminfo)
  if [ "$shm_avail" -lt 60 ] || [ "$mem_avail" -lt 68 ]; then
    echo "skipped: /dev/shm ${shm_avail} GiB free, MemAvailable ${mem_avail} GiB (60 and 68" \
      "needed)" > "$OUT/moe48.txt"
  else
    BUDGET=$((SECONDS - T0 + 400))
    step moe48 moe48.txt 400 "$ONESHOT" --shape=moe --layers=48 \
      --reps=2 --dirs="$SHM" --no_host --first=loader:kind=loader \
      --cases="ceiling:kind=ceiling;loader:kind=loader;loader_noverify:kind=loader,verify=0"
  fi
fi

# ---- summary: every line starts with "25:" ------------------------------------------------
rows() {  # the tables of a oneshot_bench log: GB/s median, best, of the ceiling, phases, runs
  awk '/^== |^\/.*resident|GPU cases skipped/ {print "25: " $0; next}
    /^(ceiling|loader|1st_after)/ {
      n = split($0, p, "|")
      if (n == 1) { print "25:   " $0; next }
      if (n != 3) next
      split(p[1], a, " "); split(p[2], b, " ")
      printf "25:   %-20s %6s GB/s best %6s ceil %5s | plan %s ms l.alloc %s ms thr %s | %s\n",
        a[1], a[2], a[3], a[4], b[5], b[6], b[9], p[3]
    }' "$1"
}
pyrows() {  # oneshot_python.py's result lines (and PATTERN: more of them)
  grep -E "GB/s|child failed${2:+|$2}" "$1" | sed -e 's/^/25:   /'
}
echo "25: machine: $(grep -m1 H200 "$OUT/machine.txt" || echo "no H200 found")"
echo "25: 1. MoE 12 layers, C++ (GB/s median best, of ceiling | per-run GB/s)"
rows "$OUT/moe12_cpp.txt"
echo "25: 2. MoE 12 layers, Python"
pyrows "$OUT/moe12_py.txt"
echo "25: 3. 160-tensor 8 GiB file, C++ and Python, then ferry bench (warm, 5 loads)"
rows "$OUT/llama8_cpp.txt"
pyrows "$OUT/llama8_py.txt"
grep -E "^(==|load)" "$OUT/steady.txt" | paste - - | sed -e 's/^== /25:   bench /'
echo "25: 4. peers, 4-layer MoE cut written by Python"
pyrows "$OUT/peers_py.txt" "not installed|not measured"
[ -f "$OUT/moe48.txt" ] && { echo "25: 5. 48 layers"; rows "$OUT/moe48.txt"; }
echo "25: steps:$status (total $((SECONDS - T0)) s)"
exit $rc
