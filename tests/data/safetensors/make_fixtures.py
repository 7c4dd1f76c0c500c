"""Writes the safetensors fixtures of tests/safetensors_test.cc and tests/cli_test.sh with the
reference `safetensors` package (pip install safetensors numpy).

Byte k of the tensor at position j (in name order) is (7 * k + 13 * j + 1) % 251, or k % 2 for
BOOL, so the C++ tests recompute every expected byte.

    python3 tests/data/safetensors/make_fixtures.py tests/data/safetensors
"""
import json
import os
import sys

import numpy as np
from safetensors import TensorSpec, serialize_file

# (name, safetensors-python dtype, header shape, bytes per element * 2)
TENSORS = [
    ("bool.mask", "bool", (5,), 2),
    ("c64.z", "complex64", (3,), 16),
    ("empty.f16", "float16", (0, 3), 4),
    ("f16.w", "float16", (2, 3), 4),
    ("f32.scalar", "float32", (), 8),
    ("f32.w", "float32", (4, 5), 8),
    ("f4.packed", "float4_e2m1fn_x2", (2, 3), 1),  # storage shape: 2 x 6 F4 elements
    ("f64.w", "float64", (3,), 16),
    ("f8e4m3.w", "float8_e4m3fn", (8,), 2),
    ("f8e4m3fnuz.w", "float8_e4m3fnuz", (4,), 2),
    ("f8e5m2.w", "float8_e5m2", (8,), 2),
    ("f8e5m2fnuz.w", "float8_e5m2fnuz", (4,), 2),
    ("f8e8m0.scale", "float8_e8m0fnu", (4,), 2),
    ("i16.w", "int16", (3,), 4),
    ("i32.w", "int32", (3,), 8),
    ("i64.w", "int64", (2, 2), 16),
    ("i8.w", "int8", (7,), 2),
    ("model.bf16", "bfloat16", (16, 8), 4),
    ("u16.w", "uint16", (3,), 4),
    ("u32.w", "uint32", (3,), 8),
    ("u64.w", "uint64", (2,), 16),
    ("u8.w", "uint8", (9,), 2),
]


def pattern(j, nbytes, is_bool):
    k = np.arange(nbytes, dtype=np.int64)
    if is_bool:
        return (k % 2).astype(np.uint8)
    return ((7 * k + 13 * j + 1) % 251).astype(np.uint8)


def specs(tensors, keep):
    out = {}
    for j, (name, dtype, shape, twice) in enumerate(tensors):
        numel = int(np.prod(shape)) if shape else 1
        if dtype == "float4_e2m1fn_x2":
            numel *= 2  # the storage shape counts bytes of two elements
        buf = pattern(j, numel * twice // 2, dtype == "bool")
        keep.append(buf)
        out[name] = TensorSpec(dtype=dtype, shape=shape, data_ptr=buf.ctypes.data,
                               data_len=buf.nbytes)
    return out


def main(outdir):
    keep = []
    serialize_file(specs(TENSORS, keep), os.path.join(outdir, "all_dtypes.safetensors"),
                   metadata={"format": "pt", "producer": "make_fixtures.py"})
    # A sharded checkpoint: two shards and the index that maps tensors onto them.
    shard_dir = os.path.join(outdir, "sharded")
    os.makedirs(shard_dir, exist_ok=True)
    weights = {
        "model-00001-of-00002.safetensors": {
            "embed.weight": np.arange(24, dtype=np.float32).reshape(6, 4),
            "layers.0.w": np.arange(12, dtype=np.int16).reshape(3, 4),
        },
        "model-00002-of-00002.safetensors": {
            "layers.1.w": np.arange(8, dtype=np.float64),
            "norm.weight": np.ones(4, dtype=np.float16),
        },
    }
    weight_map = {}
    for shard, tensors in weights.items():
        specs_ = {k: TensorSpec(dtype=v.dtype.name, shape=v.shape, data_ptr=v.ctypes.data,
                                data_len=v.nbytes) for k, v in tensors.items()}
        serialize_file(specs_, os.path.join(shard_dir, shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in tensors})
    total = sum(v.nbytes for t in weights.values() for v in t.values())
    with open(os.path.join(shard_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
