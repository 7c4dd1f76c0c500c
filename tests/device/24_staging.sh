#!/usr/bin/env bash
# How much pinned staging the GPU-decoded and CPU-decoded encodings want (issue 24): `ferry
# bench` hot loads of a PLANES and a shuffle+zstd checkpoint in /dev/shm with 64 (the default),
# 128 and 256 MiB of staging, all cores, each beside the pinned ceiling of its run.
#   tests/device/24_staging.sh BUILD_DIR OUT_DIR [SIZE=4GiB]
# About 90 s on an H200 host; one summary line per case at the end.
set -u
BUILD="${1:?usage: 24_staging.sh BUILD_DIR OUT_DIR [SIZE]}"
OUT="${2:?usage: 24_staging.sh BUILD_DIR OUT_DIR [SIZE]}"
SIZE="${3:-4GiB}"
mkdir -p "$OUT"
FERRY="$BUILD/src/cli/ferry"
SHM=$(mktemp -d /dev/shm/ferry-stg-XXXXXX)
trap 'rm -rf "$SHM"' EXIT
status=0
for enc in planes shuffle+zstd; do
  tag=${enc//+/_}
  timeout 150 "$FERRY" bench --generate "$SIZE" --encoding "$enc" --dir "$SHM" --keep \
    --repeat 1 > "$OUT/generate_$tag.log" 2>&1 || status=1
  file=$(awk '/^kept/ {print $2}' "$OUT/generate_$tag.log")
  for mib in 64 128 256; do
    timeout 90 "$FERRY" bench "$file" --staging-mib "$mib" --repeat 5 \
      > "$OUT/${tag}_$mib.log" 2>&1 || status=1
  done
  rm -rf "${SHM:?}"/*
done
echo "== 24_staging summary (hot, median of 5; ceiling of the same run) =="
for f in "$OUT"/planes_*.log "$OUT"/shuffle_zstd_*.log; do
  case "$f" in *generate*) continue ;; esac
  printf '%-18s %s\n' "$(basename "$f" .log)" "$(grep -m1 '^summary' "$f")"
done
exit $status
