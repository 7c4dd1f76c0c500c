#!/usr/bin/env bash
# Runs several device scripts one after the other inside one time budget, so that a single
# command on the GPU machine covers a whole step; each script's logs go to OUT/<name>/, and
# OUT/<name>.tgz packs them (a few files come back more easily than many).
#   tests/device/batch.sh BUDGET_S OUT NAME=CMD... [NAME=CMD...]
# CMD is a shell command line; "$OUT_STEP" in it is that step's folder. A step starts only
# when at least 30 s of the budget are left, and is given what is left.
set -u
BUDGET=${1:?BUDGET_S}
OUT=${2:?OUT}
shift 2
mkdir -p "$OUT"
END=$((SECONDS + BUDGET))
for spec in "$@"; do
  name=${spec%%=*}
  cmd=${spec#*=}
  left=$((END - SECONDS))
  if [ "$left" -lt 30 ]; then
    echo "== $name: skipped ($left s left)"
    continue
  fi
  export OUT_STEP="$OUT/$name"
  mkdir -p "$OUT_STEP"
  t0=$SECONDS
  timeout --kill-after=5 "$left" bash -c "$cmd" > "$OUT_STEP/stdout.txt" 2>&1
  rc=$?
  echo "== $name: rc=$rc, $((SECONDS - t0)) s"
  # The summary each script prints last.
  tail -n "${BATCH_TAIL:-25}" "$OUT_STEP/stdout.txt"
  tar czf "$OUT/$name.tgz" -C "$OUT" "$name" && rm -rf "$OUT_STEP"
done
