#!/usr/bin/env bash
# The `ferry` command on real files: exit codes, output, and conversions that keep every tensor
# byte. Needs only bash and coreutils.
#   tests/cli_test.sh FERRY_BINARY FIXTURE_DIR     (FIXTURE_DIR: tests/data/safetensors)
set -uo pipefail
FERRY=$1
DATA=$2
GOLDEN="$DATA/../golden_v1.ferry"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ferry_cli_test.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
OUT="$WORK/out.txt"
checks=0
failed=0
current=""
current_failed=0

# Marks the current check failed (counted once however many expectations it misses).
fail() {
  echo "FAIL [$current]: $*"
  echo "---- output ----"
  cat "$OUT"
  echo "----------------"
  if [ "$current_failed" -eq 0 ]; then failed=$((failed + 1)); fi
  current_failed=1
}
# check NAME: starts a check that is not a command run.
check() {
  current=$1
  current_failed=0
  checks=$((checks + 1))
  : >"$OUT"
}

# run NAME EXPECTED_RC CMD...: runs CMD with stdout and stderr in $OUT.
run() {
  check "$1"
  local want=$2
  shift 2
  "$@" >"$OUT" 2>&1
  local rc=$?
  if [ "$rc" -ne "$want" ]; then
    fail "exit code $rc, expected $want: $*"
    return 1
  fi
}
has() {
  grep -qF -- "$1" "$OUT" || fail "output lacks: $1"
}
hasnt() {
  if grep -qF -- "$1" "$OUT"; then fail "output has: $1"; fi
}
# The data section of a safetensors file (everything after the header).
data_section() {
  local n
  n=$(od -An -tu8 -N8 "$1" | tr -d ' ')
  tail -c +$((9 + n)) "$1"
}
same() {
  cmp -s "$1" "$2" || fail "$1 and $2 differ"
}

ST="$DATA/all_dtypes.safetensors"
INDEX="$DATA/sharded/model.safetensors.index.json"

# ---- usage ---------------------------------------------------------------------------------
run version 0 "$FERRY" --version && has "ferry 0."
run help 0 "$FERRY" --help && has "inspect" && has "convert"
run no-subcommand 2 "$FERRY"
run unknown-subcommand 2 "$FERRY" frobnicate
run convert-missing-out 2 "$FERRY" convert "$ST"
run bench-needs-input 2 "$FERRY" bench && has "give a FILE or --generate SIZE"
run bench-bad-size 2 "$FERRY" bench --generate lots && has "--generate lots"
run bad-encoding 2 "$FERRY" convert "$ST" "$WORK/x.ferry" --encoding lz4
run encoded-safetensors 2 "$FERRY" convert "$ST" "$WORK/x.safetensors" --encoding zstd &&
  has "safetensors stores raw bytes only"
run missing-file 1 "$FERRY" inspect "$WORK/nope.ferry" && has "NotFound" && has "nope.ferry"

# ---- inspect and verify a file of the reference safetensors library --------------------------
run inspect-safetensors 0 "$FERRY" inspect "$ST" &&
  has "format     safetensors" && has "checksums  none" && has "tensors    22" &&
  has "model.bf16" && has "[16, 8]" && has "F8_E4M3FN" && has "F4_E2M1FN" && has "[2, 6]" &&
  has "producer = make_fixtures.py"
# Not a terminal: no progress bar, no escape sequences.
hasnt $'\033['
run inspect-json 0 "$FERRY" inspect --json "$ST" &&
  has '"format": "safetensors"' && has '"checksums": null' && has '"name": "f4.packed"' &&
  has '"dtype": "F8_E5M2FNUZ"' && has '"raw_bytes": 256'
run verify-safetensors 0 "$FERRY" verify "$ST" && has "checksums: unavailable"

# ---- safetensors -> ferry -> safetensors keeps every byte -------------------------------------
run to-ferry-zstd 0 "$FERRY" convert "$ST" "$WORK/z.ferry" --encoding shuffle+zstd --level 5 \
  --block-size 4KiB && has "22 tensors" && has "shuffle+zstd level 5"
run verify-ferry 0 "$FERRY" verify "$WORK/z.ferry" && has "OK" && has "22 tensors"
run inspect-ferry 0 "$FERRY" inspect "$WORK/z.ferry" && has "TensorFerry v1" &&
  has "XXH3-64" && has "shuffle+zstd"
run back-to-safetensors 0 "$FERRY" convert "$WORK/z.ferry" "$WORK/back.safetensors"
data_section "$ST" >"$WORK/a.bin"
data_section "$WORK/back.safetensors" >"$WORK/b.bin"
check safetensors-round-trip-data
same "$WORK/a.bin" "$WORK/b.bin"
# The reference library's layout (dtype order, then name), so the headers match but for the
# order of __metadata__ entries (a hash map in the reference library).
run inspect-original 0 "$FERRY" inspect --json "$ST"
grep -v '"path"' "$OUT" >"$WORK/a.json"
run inspect-back 0 "$FERRY" inspect --json "$WORK/back.safetensors"
grep -v '"path"\|"file_size"' "$OUT" >"$WORK/b.json"
grep -v '"file_size"' "$WORK/a.json" >"$WORK/a2.json"
check safetensors-round-trip-index
same "$WORK/a2.json" "$WORK/b.json"

# ---- ferry -> safetensors -> ferry keeps every byte --------------------------------------------
run to-ferry-raw 0 "$FERRY" convert "$ST" "$WORK/r1.ferry"
run raw-to-safetensors 0 "$FERRY" convert "$WORK/r1.ferry" "$WORK/r.safetensors"
run safetensors-to-raw 0 "$FERRY" convert "$WORK/r.safetensors" "$WORK/r2.ferry"
check ferry-round-trip
same "$WORK/r1.ferry" "$WORK/r2.ferry"
run re-encode 0 "$FERRY" convert "$WORK/z.ferry" "$WORK/r3.ferry" --encoding raw
check re-encode-round-trip
same "$WORK/r1.ferry" "$WORK/r3.ferry"

# ---- sharded safetensors through the index -------------------------------------------------------
run sharded 0 "$FERRY" convert "$INDEX" "$WORK/sharded.ferry" && has "2 shards" &&
  has "4 tensors"
run sharded-inspect 0 "$FERRY" inspect "$WORK/sharded.ferry" && has "embed.weight" &&
  has "layers.0.w" && has "layers.1.w" && has "norm.weight" && has "format = pt"
run sharded-to-one-safetensors 0 "$FERRY" convert "$INDEX" "$WORK/one.safetensors"
run sharded-one-inspect 0 "$FERRY" inspect "$WORK/one.safetensors" && has "tensors    4"
mkdir -p "$WORK/shards"
cp "$DATA"/sharded/*.safetensors "$WORK/shards/"
cat >"$WORK/shards/model.safetensors.index.json" <<'EOF'
{"weight_map": {"embed.weight": "model-00001-of-00002.safetensors",
                "layers.0.w": "model-00001-of-00002.safetensors",
                "layers.1.w": "model-00001-of-00002.safetensors",
                "norm.weight": "model-00002-of-00002.safetensors"}}
EOF
run sharded-wrong-map 1 "$FERRY" convert "$WORK/shards/model.safetensors.index.json" \
  "$WORK/bad.ferry" && has "tensor 'layers.1.w'" && has "does not hold it"
check no-output-on-failure
[ ! -e "$WORK/bad.ferry" ] || fail "a failed convert left $WORK/bad.ferry"
rm "$WORK/shards/model-00002-of-00002.safetensors"
run sharded-missing-shard 1 "$FERRY" convert "$WORK/shards/model.safetensors.index.json" \
  "$WORK/bad.ferry" && has "model-00002-of-00002.safetensors" && has "NotFound"

# ---- corruption: verify names the tensor and the block; convert refuses --------------------------
run to-ferry-small-blocks 0 "$FERRY" convert "$ST" "$WORK/c.ferry" --block-size 4096
run inspect-offsets 0 "$FERRY" inspect --json "$WORK/c.ferry"
offset=$(awk '/"name": "model.bf16"/ {found = 1} found && /"data_offset"/ {gsub(/[^0-9]/, ""); print; exit}' "$OUT")
check find-offset
[ -n "$offset" ] || fail "no data_offset for model.bf16"
printf '\xff' | dd of="$WORK/c.ferry" bs=1 seek=$((offset + 100)) conv=notrunc status=none
run verify-corrupt 1 "$FERRY" verify "$WORK/c.ferry" && has "FAILED" &&
  has "tensor 'model.bf16'" && has "checksum mismatch in block 0" &&
  has "1 of 21 blocks in 1 of 22 tensors do not match"
run verify-corrupt-json 1 "$FERRY" verify --json "$WORK/c.ferry" && has '"ok": false' &&
  has '"tensor": "model.bf16"'
run convert-corrupt 1 "$FERRY" convert "$WORK/c.ferry" "$WORK/c.safetensors" &&
  has "tensor 'model.bf16': checksum mismatch in block 0"
check no-output-on-failure
[ ! -e "$WORK/c.safetensors" ] || fail "a failed convert left $WORK/c.safetensors"
run convert-corrupt-to-ferry 1 "$FERRY" convert "$WORK/c.ferry" "$WORK/c2.ferry" &&
  has "tensor 'model.bf16': checksum mismatch in block 0"
run convert-corrupt-no-verify 0 "$FERRY" convert "$WORK/c.ferry" "$WORK/c.safetensors" --no-verify
# bench loads verify by default (onto the GPU, or into host memory without one).
run bench-corrupt 1 "$FERRY" bench "$WORK/c.ferry" --repeat 1 &&
  has "tensor 'model.bf16': checksum mismatch in block 0"
run bench-corrupt-no-verify 0 "$FERRY" bench "$WORK/c.ferry" --repeat 1 --no-verify &&
  has "not verifying"

# ---- malformed safetensors headers -------------------------------------------------------------
printf '\x00\x00\x00\x00\x00\x01\x00\x00{' >"$WORK/huge.safetensors"
run huge-header 1 "$FERRY" inspect "$WORK/huge.safetensors" && has "DataLoss" &&
  has "huge.safetensors: safetensors header length 1099511627776" && has "exceeds the limit"
hdr='{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}'
{ printf "\\x$(printf %02x ${#hdr})\\x00\\x00\\x00\\x00\\x00\\x00\\x00"; printf '%s' "$hdr"; printf '12345678'; } \
  >"$WORK/overlap.safetensors"
run overlap 1 "$FERRY" verify "$WORK/overlap.safetensors" &&
  has "tensor 'b': data_offsets [4, 8] overlap tensor 'a'"
hdr='{"t":{"dtype":"Q8","shape":[2],"data_offsets":[0,2]}}'
{ printf "\\x$(printf %02x ${#hdr})\\x00\\x00\\x00\\x00\\x00\\x00\\x00"; printf '%s' "$hdr"; printf 'xx'; } \
  >"$WORK/dtype.safetensors"
run unknown-dtype 1 "$FERRY" convert "$WORK/dtype.safetensors" "$WORK/d.ferry" &&
  has "unknown dtype 'Q8'"
run bad-block-size 1 "$FERRY" convert "$ST" "$WORK/x.ferry" --block-size 3000 &&
  has "block_size 3000"

# ---- FP8 descriptions travel through safetensors metadata ----------------------------------------
# u64 little-endian.
le64() {
  local i
  for i in 0 1 2 3 4 5 6 7; do printf "\\x$(printf %02x $((($1 >> (8 * i)) & 255)))"; done
}
# safetensors FILE HEADER DATA
safetensors_file() {
  { le64 ${#2}; printf '%s' "$2"; printf '%s' "$3"; } >"$1"
}
q='[{\"name\":\"w\",\"quantized_dtype\":\"F8_E4M3FN\",\"logical_dtype\":\"BF16\",\"shape\":[2,4],\"scaling_mode\":\"per-tensor\",\"rowwise\":{\"data\":\"w.fp8\",\"scale_inv\":\"w.scale_inv\",\"scale_layout\":\"row-major\",\"amax\":\"w.amax\"},\"columnwise\":null}]'
sc='[{\"module\":\"layers.0.fc1\",\"recipe\":{\"type\":\"DelayedScaling\",\"margin\":1,\"fp8_format\":\"E4M3\",\"amax_history_len\":2,\"amax_compute_algo\":\"max\",\"reduce_amax\":true,\"fp8_dpa\":false,\"fp8_mha\":false},\"states\":[{\"direction\":\"forward\",\"num_gemms\":1,\"slot_roles\":[\"input\",\"weight\"],\"scale\":[0.5,\"inf\"],\"history_len\":2,\"amax_history\":[1.25,\"nan\",3e-38,-0.0]}]}]'
hdr='{"__metadata__":{"step":"7","tensorferry.quantized":"'"$q"'","tensorferry.scaling":"'"$sc"'"},'
hdr+='"w.amax":{"dtype":"F32","shape":[],"data_offsets":[0,4]},'
hdr+='"w.scale_inv":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},'
hdr+='"w.fp8":{"dtype":"F8_E4M3","shape":[2,4],"data_offsets":[8,16]}}'
safetensors_file "$WORK/fp8.safetensors" "$hdr" "aaaabbbbcccccccc"
run fp8-from-safetensors 0 "$FERRY" convert "$WORK/fp8.safetensors" "$WORK/fp8.ferry"
run fp8-inspect 0 "$FERRY" inspect "$WORK/fp8.ferry" && has "quantized tensors (1)" &&
  has "w: F8_E4M3FN -> BF16 [2, 4], per-tensor" &&
  has "rowwise: data w.fp8, scale_inv w.scale_inv (row-major), amax w.amax" &&
  has "layers.0.fc1: DelayedScaling(margin=1, fp8_format=E4M3" &&
  has "scale [0.5, inf]" && has "current amax [1.25, nan]" && has "step = 7" &&
  hasnt "tensorferry.quantized"
run fp8-to-safetensors 0 "$FERRY" convert "$WORK/fp8.ferry" "$WORK/fp8-back.safetensors"
run fp8-back-inspect 0 "$FERRY" inspect --json "$WORK/fp8-back.safetensors" &&
  has '"tensorferry.quantized"' && has '"tensorferry.scaling"'
run fp8-back-to-ferry 0 "$FERRY" convert "$WORK/fp8-back.safetensors" "$WORK/fp8-again.ferry"
check fp8-round-trip
same "$WORK/fp8.ferry" "$WORK/fp8-again.ferry"
hdr='{"__metadata__":{"tensorferry.scaling":"[{\"module\":3}]"},'
hdr+='"t":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}'
safetensors_file "$WORK/bad-fp8.safetensors" "$hdr" "xy"
run fp8-bad-description 0 "$FERRY" convert "$WORK/bad-fp8.safetensors" "$WORK/bad-fp8.ferry" &&
  has "warning" && has "'tensorferry.scaling' is kept as plain metadata" &&
  has "scaling state: \"module\" is not a string"

# ---- FP8 recipes, scaling state and quantized tensors (the golden v1 file) ----------------------
if [ -f "$GOLDEN" ]; then
  run inspect-golden 0 "$FERRY" inspect "$GOLDEN" && has "quantized tensors" &&
    has "scaling state" && has "DelayedScaling(" && has "MXFP8BlockScaling" &&
    has "CustomRecipe(name=my.Recipe" && has "rowwise: data"
  run inspect-golden-json 0 "$FERRY" inspect --json "$GOLDEN" && has '"recipe"' &&
    has '"amax_history"' && has '"scaling_mode"'
  run verify-golden 0 "$FERRY" verify "$GOLDEN" && has "OK"
  # Its NVFP4 weight holds an odd number of F4 elements: not whole bytes, so not safetensors.
  run golden-to-safetensors 1 "$FERRY" convert "$GOLDEN" "$WORK/golden.safetensors" &&
    has "tensor 'nvfp4.weight' holds 15 F4 elements"
  check golden-no-output
  [ ! -e "$WORK/golden.safetensors" ] || fail "a failed convert left its output"
  run golden-to-ferry 0 "$FERRY" convert "$GOLDEN" "$WORK/golden.ferry" --encoding zstd
  run golden-copy-inspect 0 "$FERRY" inspect "$WORK/golden.ferry" && has "quantized tensors" &&
    has "CustomRecipe(name=my.Recipe"
fi

# ---- bench --------------------------------------------------------------------------------------
run bench-generate 0 "$FERRY" bench --generate 4MiB --repeat 2 --dir "$WORK" &&
  has "llama-like" && has "run 2/2" && has "ceiling" && has "ratio" && has "GB/s"
check bench-cleanup
if ls -d "$WORK"/ferry-bench-* >/dev/null 2>&1; then fail "bench left its checkpoint behind"; fi
run bench-keep 0 "$FERRY" bench --generate 2MiB --repeat 1 --dir "$WORK" --keep --prealloc \
  --threads 2 --slot-mib 1 --staging-mib 8 --path staging && has "kept" &&
  has "into preallocated buffers"
run bench-file 0 "$FERRY" bench "$ST" --repeat 1 && has "22 tensors" && has "ceiling"
# Compressed files whose stored bytes are much smaller than their raw bytes (16 MiB of zeros
# compress to a few KiB): the host ceiling reads each stored block where it lies, never raw-sized
# ranges from there, which ran off the mapping.
n=$((16 << 20))
hdr="{\"z\":{\"dtype\":\"U8\",\"shape\":[$n],\"data_offsets\":[0,$n]}}"
{ le64 ${#hdr}; printf '%s' "$hdr"; head -c "$n" /dev/zero; } >"$WORK/zeros.safetensors"
for enc in zstd shuffle+zstd shuffle_zstd planes; do
  run "convert-zeros-$enc" 0 "$FERRY" convert "$WORK/zeros.safetensors" "$WORK/zeros.ferry" \
    --encoding "$enc" && has "TensorFerry, ${enc/_/+}"
  run "bench-compressed-$enc" 0 "$FERRY" bench "$WORK/zeros.ferry" --repeat 1 &&
    has "ceiling" && has "ratio"
  has "decode of the same blocks by the codec alone"
done
run bench-encoding-spelling 0 "$FERRY" bench --generate 2MiB --repeat 1 --dir "$WORK" \
  --encoding shuffle_zstd && has "ceiling"
run bench-bad-encoding 2 "$FERRY" bench --generate 2MiB --encoding lz4 &&
  has "raw, zstd, shuffle+zstd (or shuffle_zstd), planes"

# Ctrl-C while --generate writes: the writer's temporary file and the folder bench made go too.
bench_interrupt() {  # SIGNAL EXPECTED_RC
  check "bench-interrupt-$1"
  mkdir -p "$WORK/gen"
  set -m
  "$FERRY" bench --generate 2GiB --encoding zstd --dir "$WORK/gen" >"$OUT" 2>&1 &
  local pid=$!
  set +m
  for _ in $(seq 200); do
    ls "$WORK"/gen/ferry-bench-*/bench.ferry.tmp.* >/dev/null 2>&1 && break
    sleep 0.05
  done
  ls "$WORK"/gen/ferry-bench-*/bench.ferry.tmp.* >/dev/null 2>&1 || fail "no temporary file appeared"
  kill -s "$1" "$pid"
  wait "$pid"
  local rc=$?
  [ "$rc" -eq "$2" ] || fail "exit code $rc, expected $2"
  has "generation interrupted by $1"
  [ -z "$(ls -A "$WORK/gen")" ] || fail "left behind: $(ls -R "$WORK/gen")"
  rm -rf "$WORK/gen"
}
bench_interrupt SIGINT 130
bench_interrupt SIGTERM 143

# ---- the output format: --to or a known extension, nothing by default ----------------------------
for name in out.pt pytorch_model.bin model.safetensor model; do
  run "convert-refuses-$name" 2 "$FERRY" convert "$ST" "$WORK/$name" &&
    has "cannot tell which format to write" && has "--to ferry|safetensors"
  check "convert-refused-$name-wrote-nothing"
  [ ! -e "$WORK/$name" ] || fail "$WORK/$name was written"
done
run convert-to-ferry 0 "$FERRY" convert "$ST" "$WORK/out.pt" --to ferry && has "TensorFerry, raw"
run convert-to-ferry-inspect 0 "$FERRY" inspect "$WORK/out.pt" && has "TensorFerry v1"
run convert-to-safetensors 0 "$FERRY" convert "$WORK/out.pt" "$WORK/out.st" --to safetensors
run convert-to-safetensors-inspect 0 "$FERRY" inspect "$WORK/out.st" && has "format     safetensors"
run convert-to-contradicts 2 "$FERRY" convert "$ST" "$WORK/c.safetensors" --to ferry &&
  has "the name says safetensors"
run convert-to-unknown 2 "$FERRY" convert "$ST" "$WORK/c.ferry" --to pickle

# ---- a save the system refuses names the destination, not its temporary file --------------------
for out in ferry safetensors; do
  run "convert-missing-folder-$out" 1 "$FERRY" convert "$ST" "$WORK/no_such_folder/x.$out" &&
    has "IoError: $WORK/no_such_folder/x.$out: " && has "errno 2)" && hasnt ".tmp."
  # A file size limit: write() fails with EFBIG (SIGXFSZ ignored, as the child inherits that).
  run "convert-file-size-limit-$out" 1 bash -c 'trap "" XFSZ; ulimit -f 1; exec "$@"' _ \
    "$FERRY" convert "$ST" "$WORK/limited.$out" &&
    has "IoError: $WORK/limited.$out: " && has "errno 27)" && hasnt ".tmp."
  check "convert-file-size-limit-$out-left-nothing"
  if ls "$WORK"/limited.* >/dev/null 2>&1; then fail "$(ls "$WORK"/limited.*) left behind"; fi
done

# ---- a file of another kind says what it looks like, not "bad magic" ------------------------------
run verify-sharded-index 1 "$FERRY" verify "$DATA/sharded/model.safetensors.index.json" &&
  has "InvalidArgument: $DATA/sharded/model.safetensors.index.json: not a TensorFerry checkpoint: it looks like the index of a sharded checkpoint" &&
  hasnt "bad magic"

# ---- destinations that are not regular files are refused, and left as they were ------------------
mkfifo "$WORK/fifo"
mkdir "$WORK/folder"
ln -s /dev/null "$WORK/null"
for dest in fifo folder null; do
  for out in ferry safetensors; do
    run "convert-refuses-$dest-$out" 1 "$FERRY" convert "$ST" "$WORK/$dest" --to "$out" &&
      has "not a regular file"
  done
done
check special-files-kept
[ -p "$WORK/fifo" ] || fail "the FIFO was replaced"
[ -c /dev/null ] || fail "/dev/null was replaced"
[ -z "$(ls -A "$WORK/folder")" ] || fail "something was written into the folder"
if ls "$WORK"/*.tmp.* /dev/null.tmp.* >/dev/null 2>&1; then fail "a temporary file was left"; fi

# ---- --json of a good file whose path is not UTF-8 ----------------------------------------------
BADNAME="$WORK/$(printf 'caf\xe9')"
cp "$ST" "$BADNAME.safetensors"
cp "$WORK/r1.ferry" "$BADNAME.ferry"
for f in "$BADNAME.safetensors" "$BADNAME.ferry"; do
  run "verify-json-non-utf8-path-${f##*.}" 0 "$FERRY" verify --json "$f" && has '"ok": true' &&
    has '"path": "' && hasnt "JSON" && hasnt "Internal"
  run "inspect-json-non-utf8-path-${f##*.}" 0 "$FERRY" inspect --json "$f" && has '"tensors"'
done
# An encoded file: its loads beside the codec's own decode rate on the same blocks (the host
# ceiling once read raw-sized ranges of the stored bytes, past the end of the mapping).
run bench-encoded 0 "$FERRY" bench --generate 8MiB --encoding shuffle+zstd --repeat 1 \
  --threads 2 --dir "$WORK" && has "decode      1 thread" && has "of 2 x the 1-thread decode"

# ---- -V, --quiet ------------------------------------------------------------------------------
run version-short 0 "$FERRY" -V && has "ferry 0."
run quiet-convert 0 "$FERRY" convert "$ST" "$WORK/q.ferry" --quiet
check quiet-convert-prints-nothing
[ ! -s "$OUT" ] || fail "--quiet printed something"
run quiet-verify 0 "$FERRY" -q verify "$WORK/q.ferry"
check quiet-verify-prints-nothing
[ ! -s "$OUT" ] || fail "--quiet printed something"
run quiet-still-reports-errors 1 "$FERRY" --quiet inspect "$WORK/nope.ferry" && has "nope.ferry"

# ---- a conversion that takes seconds: 128 MiB of random bytes through zstd level 12, one thread
# (progress is drawn after one second, and a fast machine converts 32 MiB in less)
BIG="$WORK/big.safetensors"
n=$((128 << 20))
hdr="{\"x\":{\"dtype\":\"U8\",\"shape\":[$n],\"data_offsets\":[0,$n]}}"
while [ $((${#hdr} % 8)) -ne 0 ]; do hdr="$hdr "; done
{
  for i in 0 1 2 3 4 5 6 7; do printf "\\$(printf '%03o' $(((${#hdr} >> (8 * i)) & 255)))"; done
  printf '%s' "$hdr"
  head -c "$n" /dev/urandom
} >"$BIG"
SLOW=(convert "$BIG" --encoding zstd --level 12 --threads 1)

# Progress on a 36-column terminal (a pseudo-terminal from script(1)): every redraw fits in 35
# columns, so none wraps onto a new line, and what does not fit is left out by whole fields:
# no number is cut short.
check progress-fits-the-terminal
script -qfec "stty cols 36 rows 24; $(printf '%q ' "$FERRY" "${SLOW[@]}" "$WORK/tty.ferry")" \
  "$WORK/tty.log" >/dev/null 2>&1 || fail "convert under a terminal failed"
tr '\r' '\n' <"$WORK/tty.log" | grep -a $'^\033\[Kconverting' | sed $'s/^\033\[K//' >"$OUT"
[ -s "$OUT" ] || fail "no progress line was drawn"
awk 'length($0) > 35 { bad = 1 } END { exit bad }' "$OUT" || fail "a progress line is wider than 35"
size='[0-9]+(\.[0-9]+)? (B|[KMGTP]iB)'
whole="^converting( \[[#.]+\])?( +[0-9]+%( $size / $size(  [0-9.]+ GB/s(  ETA [0-9]+ s)?)?)?)?\$"
grep -Evq "$whole" "$OUT" && fail "a progress line holds a cut field: $(grep -Ev "$whole" "$OUT" | head -1)"

# Ctrl-C and SIGTERM during convert: exit 128+signal, no temporary file left, and a file that
# was at OUT before is untouched.
interrupt() {  # SIGNAL EXPECTED_RC
  check "interrupt-$1"
  cp "$WORK/q.ferry" "$WORK/int.ferry"
  set -m  # a job of its own: background jobs of a script would otherwise ignore SIGINT
  "$FERRY" "${SLOW[@]}" "$WORK/int.ferry" >"$OUT" 2>&1 &
  local pid=$!
  set +m
  for _ in $(seq 200); do
    ls "$WORK"/int.ferry.tmp.* >/dev/null 2>&1 && break
    sleep 0.05
  done
  ls "$WORK"/int.ferry.tmp.* >/dev/null 2>&1 || fail "no temporary file appeared"
  kill -s "$1" "$pid"
  wait "$pid"
  local rc=$?
  [ "$rc" -eq "$2" ] || fail "exit code $rc, expected $2"
  has "interrupted by $1"
  if ls "$WORK"/int.ferry.tmp.* >/dev/null 2>&1; then fail "temporary file left behind"; fi
  same "$WORK/q.ferry" "$WORK/int.ferry"
}
interrupt SIGINT 130
interrupt SIGTERM 143

echo "cli_test: $((checks - failed)) passed, $failed failed"
[ "$failed" -eq 0 ]
