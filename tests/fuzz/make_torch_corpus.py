"""Writes the seeds of fuzz_torch_walk and fuzz_dcp (tests/fuzz/corpus/torch_walk/ and
tests/fuzz/corpus/dcp/), built by tests/python/torch_like.py (no torch needed). Deterministic.

    python3 tests/fuzz/make_torch_corpus.py tests/fuzz/corpus

fuzz_torch_walk input: u32 n, n bytes of data.pkl, then each storage ("0", "1", ...) as a u32
length and its bytes. fuzz_dcp input: u32 n, n bytes of .metadata, then the data file.
"""

import collections
import io
import os
import struct
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import torch_like as tl  # noqa: E402


def framed(b):
    return struct.pack("<I", len(b)) + b


def walk_seed(obj, protocol=2):
    storages = {}
    buf = io.BytesIO()
    with tl.fake_modules():
        tl._Pickler(buf, storages, protocol).dump(obj)
    out = framed(buf.getvalue())
    for k in range(len(storages)):
        out += framed(storages[str(k)].data)
    return out


def dcp_seed(state_dict, chunks=None):
    with tempfile.TemporaryDirectory() as d:
        tl.dcp_save(state_dict, d, chunks=chunks)
        with open(os.path.join(d, ".metadata"), "rb") as f:
            meta = f.read()
        with open(os.path.join(d, "__0_0.distcp"), "rb") as f:
            data = f.read()
    return framed(meta) + data


def main():
    out = sys.argv[1]
    base = tl.Storage(np.arange(24, dtype=np.float32).tobytes(), "float32")
    views = collections.OrderedDict(
        w=tl.Tensor(base, (4, 6)), t=tl.Tensor(base, (6, 4), stride=(1, 6)),
        o=tl.Tensor(base, (2, 3), offset=5), b=tl.Tensor(base, (3, 4), stride=(0, 1)),
        s=tl.Tensor(base, (), offset=23), e=tl.Tensor(base, (0, 4)))
    dtypes = collections.OrderedDict(
        (name, tl.Tensor(tl.Storage(bytes(range(8)), name), (8 // tl.DTYPES[name][2],)))
        for name in ("bfloat16", "float8_e4m3fn", "float4_e2m1fn_x2", "uint16"))
    tied = tl.tensor(np.ones((2, 2), np.float32))
    te, _ = tl.te_state(tl.recipe.DelayedScaling(), make=tl.plain_tensor)
    te_bytesio, _ = tl.te_state(tl.recipe.Float8CurrentScaling(),
                                make=lambda a: tl.tensor(a, location="cuda:0"))
    te_dict, _ = tl.te_state(tl.recipe.MXFP8BlockScaling(), num_gemms=2)
    walk = {
        "views.bin": walk_seed({"model": views, "epoch": 3, "lr": 0.5, "name": "run"}),
        "dtypes.bin": walk_seed(dtypes, protocol=4),
        "tied_and_nested.bin": walk_seed(
            {"a": tied, "b": tied, "opt": {"state": {0: {"exp_avg": tied}},
                                          "param_groups": [{"lr": 0.1, "params": [0, 1]}]},
             "list": [1, 2.5, "x", None, True], "tuple": (tied, 3)}, protocol=5),
        "extra_state.bin": walk_seed(collections.OrderedDict([
            ("fc.weight", tl.tensor(np.ones((2, 2), np.float32))),
            ("fc._extra_state", tl.uint8_tensor(tl.plain_pickle(te))),
            ("ln._extra_state", io.BytesIO(tl.torch_save_bytes(te_bytesio))),
            ("mlp._extra_state", te_dict),
            ("empty._extra_state", tl.uint8_tensor(b""))])),
    }
    full = np.arange(40, dtype=np.float32).reshape(8, 5)
    dcp = {
        "two_tensors.bin": dcp_seed({"layer.weight": tl.tensor(full[:3]),
                                     "layer.bias": tl.tensor(np.arange(3, dtype=np.int64))}),
        "chunks.bin": dcp_seed({"w": tl.tensor(full)}, chunks={
            "w": [((0, 0), tl.tensor(full[:3])), ((3, 0), tl.tensor(full[3:]))]}),
        "extra_state.bin": dcp_seed({
            "fc._extra_state": tl.uint8_tensor(tl.plain_pickle(te)),
            "fc.weight": tl.tensor(np.ones(4, np.float16))}),
    }
    for target, seeds in (("torch_walk", walk), ("dcp", dcp)):
        os.makedirs(os.path.join(out, target), exist_ok=True)
        for name, data in seeds.items():
            with open(os.path.join(out, target, name), "wb") as f:
                f.write(data)


if __name__ == "__main__":
    main()
