#!/usr/bin/env bash
# Converts the same inputs with two builds of the `ferry` command and compares the outputs byte
# for byte: a refactoring that says "no behaviour change" must write the same files.
#
#   tests/compare_builds.sh OLD_FERRY NEW_FERRY [WORK_DIR]
#
# Inputs: tests/data (safetensors, sharded safetensors, torch.save files, a sharded .bin index,
# a DCP folder) and one generated safetensors file of several MiB (bf16-like, float32, int8 and
# odd-sized tensors, so that every encoding has blocks to compress and tails to pad). Each goes
# to TensorFerry in every encoding (raw, zstd, shuffle+zstd, planes; default and 64 KiB blocks),
# TensorFerry back to safetensors and re-encoded, and torch inputs also to safetensors.
#
# A difference is explained, not just reported: when every byte that differs is zero in the
# NEW file and the files have the same size, it is padding that NEW zeroes and OLD left as it
# was (PLANES blocks' alignment gaps are zeroed since the encoder reuses its buffers); any other
# difference fails. A conversion OLD refuses (an input it does not read) is skipped and counted;
# one that only NEW refuses fails. Not run in CI: it needs a build from before the change.
# Exit status: 0 when no unexplained difference, 1 otherwise.
set -uo pipefail
if [[ $# -lt 2 ]]; then
  echo "usage: $0 OLD_FERRY NEW_FERRY [WORK_DIR]" >&2
  exit 2
fi
OLD="$(realpath "$1")"
NEW="$(realpath "$2")"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DATA="$ROOT/tests/data"
if [[ $# -ge 3 ]]; then
  WORK="$3"
  mkdir -p "$WORK"
else
  WORK="$(mktemp -d)"
  trap 'rm -rf "$WORK"' EXIT
fi
mkdir -p "$WORK/in" "$WORK/old" "$WORK/new"

# Several MiB of deterministic data, standard library only.
python3 - "$WORK/in/generated.safetensors" <<'EOF'
import json, random, struct, sys

rng = random.Random(20261201)
def bf16(n):  # the top halves of float32 normals: the planes and shuffle codecs' case
    return b"".join(struct.pack("<f", rng.gauss(0, 0.02))[2:] for _ in range(n))
def f32(n):
    return struct.pack("<%df" % n, *(rng.gauss(0, 1) for _ in range(n)))
tensors = [
    ("layers.0.weight", "BF16", [1024, 1536], bf16(1024 * 1536)),
    ("layers.0.bias", "F32", [1536], f32(1536)),
    ("layers.1.weight", "F32", [300, 257], f32(300 * 257)),
    ("embed.ids", "I8", [4099], bytes(rng.randrange(16) for _ in range(4099))),
    ("noise", "U8", [1 << 20], rng.randbytes(1 << 20)),
    ("zeros", "F16", [70000], bytes(140000)),
    ("odd", "BF16", [3, 5, 7], bf16(105)),
]
header, blobs, off = {"__metadata__": {"source": "compare_builds"}}, [], 0
for name, dtype, shape, blob in tensors:
    header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(blob)]}
    blobs.append(blob)
    off += len(blob)
h = json.dumps(header, separators=(",", ":")).encode()
h += b" " * (-len(h) % 8)
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
EOF

same=0
padding=0
skipped=0
failed=0

# compare NAME: OLD's and NEW's output of one conversion.
compare() {
  local name="$1" a="$WORK/old/$1" b="$WORK/new/$1"
  if cmp -s "$a" "$b"; then
    same=$((same + 1))
    printf '  same     %s (%s bytes)\n' "$name" "$(stat -c %s "$b")"
    return
  fi
  if [[ "$(stat -c %s "$a")" == "$(stat -c %s "$b")" ]]; then
    # cmp -l: offset (1-based), OLD byte, NEW byte, in octal.
    local counts
    counts="$(cmp -l "$a" "$b" | awk '{n++; if ($3 != 0) z++} END {print n + 0, z + 0}')"
    local n="${counts% *}" nonzero="${counts#* }"
    if [[ "$nonzero" == 0 ]]; then
      padding=$((padding + 1))
      printf '  padding  %s: %s bytes differ, all zero in NEW (padding NEW zeroes)\n' "$name" "$n"
      return
    fi
    printf '  DIFFERS  %s: %s bytes differ, %s of them nonzero in NEW\n' "$name" "$n" "$nonzero"
  else
    printf '  DIFFERS  %s: %s bytes (OLD) against %s (NEW)\n' "$name" "$(stat -c %s "$a")" \
      "$(stat -c %s "$b")"
  fi
  failed=$((failed + 1))
}

# convert NAME IN [OPTIONS...]: both builds convert IN into NAME, then compare.
convert() {
  local name="$1" in="$2"
  shift 2
  rm -f "$WORK/old/$name" "$WORK/new/$name"
  if ! "$OLD" convert "$@" "$in" "$WORK/old/$name" >"$WORK/old/$name.log" 2>&1; then
    skipped=$((skipped + 1))
    printf '  skipped  %s: OLD refuses it (%s)\n' "$name" "$(tail -n 1 "$WORK/old/$name.log")"
    return
  fi
  if ! "$NEW" convert "$@" "$in" "$WORK/new/$name" >"$WORK/new/$name.log" 2>&1; then
    failed=$((failed + 1))
    printf '  FAILED   %s: NEW refuses what OLD converts (%s)\n' "$name" \
      "$(tail -n 1 "$WORK/new/$name.log")"
    return
  fi
  compare "$name"
}

echo "OLD: $OLD"
echo "NEW: $NEW"
echo "safetensors -> TensorFerry"
for in in "$DATA/safetensors/all_dtypes.safetensors" \
  "$DATA/safetensors/sharded/model.safetensors.index.json" "$WORK/in/generated.safetensors"; do
  stem="$(basename "$in")"
  stem="${stem%%.*}"
  for enc in raw zstd shuffle+zstd planes; do
    convert "$stem.$enc.ferry" "$in" --encoding "$enc" --threads 2
    convert "$stem.$enc.64k.ferry" "$in" --encoding "$enc" --block-size 64KiB --threads 2
  done
  convert "$stem.zstd9.ferry" "$in" --encoding zstd --level 9 --threads 2
done

echo "TensorFerry -> TensorFerry and safetensors (from OLD's raw files)"
for stem in all_dtypes generated; do
  src="$WORK/old/$stem.raw.ferry"
  [[ -f "$src" ]] || continue
  convert "$stem.back.safetensors" "$src"
  convert "$stem.reencoded.zstd.ferry" "$src" --encoding shuffle+zstd --threads 2
  convert "$stem.reencoded.planes.ferry" "$src" --encoding planes --threads 2
done
convert "golden_v1.reencoded.ferry" "$DATA/golden_v1.ferry" --encoding zstd

echo "PyTorch -> TensorFerry and safetensors"
for in in "$DATA"/torch/*.pt "$DATA/torch/pytorch_model.bin" \
  "$DATA/torch/pytorch_model.bin.index.json" "$DATA/torch/dcp"; do
  stem="$(basename "$in")"
  stem="${stem%%.*}"
  [[ "$in" == *.index.json ]] && stem="${stem}_index"
  convert "torch_$stem.raw.ferry" "$in"
  convert "torch_$stem.zstd.ferry" "$in" --encoding shuffle+zstd --threads 2
  convert "torch_$stem.planes.ferry" "$in" --encoding planes --threads 2
  convert "torch_$stem.safetensors" "$in"
done

echo "compare_builds: $same identical, $padding differing in padding only, $skipped skipped" \
  "(OLD refuses), $failed differing or failing"
[[ "$failed" == 0 ]]
