#!/usr/bin/env bash
# Distributed loads on two GPUs (issue 27, items 2-4; issue 26, item 5):
#   1. distributed_bench bench: 2 ranks, 8 GiB in /dev/shm, hot, per-rank GB/s (goal >= 80),
#      bit-exact on both ranks, NVML: each process on its own GPU only (the report names what
#      each process holds on which GPU);
#   2. the same kind of checkpoint (GIB_REMOTE GiB) on the local S3 server (moto) or, where moto
#      is missing, over HTTP (nginx, else the Python range server of tests/servers/servers.py):
#      each rank fetches its 1/N of the object and NCCL shares the rest; per-rank wall time and
#      GB/s, the bytes each rank fetched from the server against 1/N of the object, bit-exact.
#   tests/device/27_dist.sh BUILD_DIR OUT_DIR [GIB_REMOTE=2]
# Needs 2 GPUs (exit 77 from distributed_bench otherwise). About 3-4 minutes on 2 x H200.
set -uo pipefail
usage="usage: 27_dist.sh BUILD_DIR OUT_DIR [GIB_REMOTE]"
BUILD="$(cd "${1:?$usage}" && pwd)"
OUT="${2:?$usage}"
GIB_REMOTE="${3:-2}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
HERE="$(cd "$(dirname "$0")/../.." && pwd)"
BENCH="$BUILD/tests/distributed_bench"
[ -x "$BENCH" ] || BENCH="$BUILD/distributed_bench"
export NCCL_NVLS_ENABLE=0
status=0
{
  date -u
  nproc
  nvidia-smi --query-gpu=index,name,driver_version,memory.used --format=csv 2>&1
  nvidia-smi topo -m 2>&1
} > "$OUT/machine.txt"

step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2
  shift 2
  timeout --kill-after=5 "$secs" "$@" > "$OUT/$name.log" 2>&1 ||
    { echo "$name: exit $?" >> "$OUT/errors.txt"; status=1; }
}

# 1. hot, 8 GiB (no cold rows: issue 27 asks for the hot figure).
step hot 300 "$BENCH" bench --gib=8 --no-cold --iters=3

# 2. the remote copy: write it (a short hot run that keeps its file), put it on a server, load.
SHM=/dev/shm/ferry27
mkdir -p "$SHM"
step remote_write 200 "$BENCH" bench --gib="$GIB_REMOTE" --no-cold --iters=1 --keep \
  --hot-dir="$SHM"
FILE="$SHM/ferry_distributed_bench.ferry"
SERVERS="$SHM/servers"
if [ -f "$FILE" ] && python3 "$HERE/tests/servers/servers.py" start --dir "$SERVERS" \
  > /dev/null 2> "$OUT/servers.err"; then
  URL=$(python3 - "$SERVERS/servers.json" "$FILE" << 'EOF'
import json, os, shutil, sys
info = json.load(open(sys.argv[1]))
path = sys.argv[2]
name = "dist/" + os.path.basename(path)
if "s3" in info:
    import boto3
    s3 = info["s3"]
    boto3.client("s3", endpoint_url=s3["endpoint"], region_name=s3["region"],
                 aws_access_key_id=s3["access_key_id"],
                 aws_secret_access_key=s3["secret_access_key"]).upload_file(
                     path, s3["bucket"], name)
    print("s3://%s/%s" % (s3["bucket"], name))
else:
    dst = os.path.join(info["root"], name)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    try:
        os.link(path, dst)
    except OSError:
        shutil.copyfile(path, dst)
    base = info.get("http") or info["fault"] + "/dist/ok/0"
    print("%s/%s" % (base, name))
for what, why in info.get("missing", {}).items():
    print("missing %s: %s" % (what, why), file=sys.stderr)
EOF
  )
  echo "remote checkpoint: $URL" | tee "$OUT/remote_url.txt"
  eval "$(python3 -c "
import json, shlex
s3 = json.load(open('$SERVERS/servers.json')).get('s3')
if s3:
    for k, v in (('AWS_ENDPOINT_URL', s3['endpoint']), ('AWS_ACCESS_KEY_ID', s3['access_key_id']),
                 ('AWS_SECRET_ACCESS_KEY', s3['secret_access_key']), ('AWS_REGION', s3['region']),
                 ('AWS_S3_ADDRESSING_STYLE', 'path')):
        print('export %s=%s' % (k, shlex.quote(v)))
")"
  [ -n "$URL" ] && step remote 300 "$BENCH" bench --gib="$GIB_REMOTE" --no-cold --iters=2 \
    --keep --hot-dir="$SHM" --remote="$URL"
  python3 "$HERE/tests/servers/servers.py" stop --dir "$SERVERS"
else
  echo "remote: no checkpoint or no servers (see servers.err)" >> "$OUT/errors.txt"
  status=1
fi
rm -rf "$SHM"

echo "== summary"
for f in hot remote; do
  [ -f "$OUT/$f.log" ] && { echo "-- $f"; sed -n '/^Distributed load/,$p' "$OUT/$f.log"; }
done
[ -s "$OUT/errors.txt" ] && { echo "-- errors"; cat "$OUT/errors.txt"; }
exit $status
