"""Writes the fuzz_unpickle seeds (tests/fuzz/corpus/unpickle/): small torch.save archives,
TransformerEngine extra-state pickles and a legacy storage stream, built by
tests/python/torch_like.py (no torch needed). Deterministic.

    python3 tests/fuzz/make_unpickle_corpus.py tests/fuzz/corpus/unpickle
"""

import collections
import io
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import torch_like as tl  # noqa: E402


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    base = tl.Storage(np.arange(24, dtype=np.float32).tobytes(), "float32")
    sd = collections.OrderedDict(
        w=tl.Tensor(base, (4, 6)), t=tl.Tensor(base, (6, 4), stride=(1, 6)),
        o=tl.Tensor(base, (2, 3), offset=5), f8=tl.tensor(np.arange(4, dtype=np.uint8),
                                                          dtype="float8_e4m3fn"))
    state, _ = tl.te_state(tl.recipe.DelayedScaling(), make=tl.plain_tensor)
    seeds = {
        "state_dict.pt": tl.torch_save_bytes(sd),
        "te_extra_state_v2.pkl": tl.plain_pickle(state),
        "te_extra_state_recipes.pkl": tl.plain_pickle(
            [tl.recipe.Float8CurrentScaling(), tl.recipe.MXFP8BlockScaling(),
             tl.recipe.Float8BlockScaling(), tl.recipe.NVFP4BlockScaling()], protocol=2),
        "te_bytesio.pt": tl.torch_save_bytes(
            {"m._extra_state": io.BytesIO(tl.torch_save_bytes(tl.te_state(
                tl.recipe.DelayedScaling(), make=lambda a: tl.tensor(a, location="cuda:0"))[0]))}),
        "legacy_storage.bin": tl.legacy_storage_bytes(
            tl.Storage(np.ones(3, np.float32).tobytes(), "float32")),
        "containers.pkl": tl.plain_pickle({"a": [1, 2.5, "x", b"y", None, True, (1, 2)],
                                           "s": {1, 2}, "big": 1 << 80}, protocol=5),
    }
    for name, data in seeds.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main()
