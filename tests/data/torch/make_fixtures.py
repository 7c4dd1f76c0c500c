"""Writes PyTorch checkpoints made by the real torch, and a manifest of what they hold, for
tests/python/test_torch_import.py (test_real_torch_fixtures) and tests/device/18_torch_import.sh.

    python3 make_fixtures.py OUTDIR

Needs torch (any 2.x; written with 2.11). CUDA is used when present, for extra state holding
CUDA tensors; without it those cases are written with CPU tensors and say so in the manifest.
Everything is small (well under 2 MB). The manifest (OUTDIR/manifest.json) lists each case:
its path, and for each tensor the TensorFerry dtype, shape and SHA-256 of its dense row-major
bytes as torch itself computes them; for TransformerEngine-style extra state the expected
scale and amax history; for refused inputs the expected error text.

TransformerEngine is not needed: its recipe classes are stood in for by dataclasses with
TransformerEngine's module and class names (tests/python/torch_like.py), which pickle exactly
as the real ones do.
"""

import collections
import hashlib
import io
import json
import os
import pickle
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

FERRY = {
    "float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16", "int8": "I8",
    "int16": "I16", "int32": "I32", "int64": "I64", "uint8": "U8", "uint16": "U16",
    "uint32": "U32", "uint64": "U64", "bool": "BOOL", "complex64": "C64", "complex128": "C128",
    "float8_e4m3fn": "F8_E4M3FN", "float8_e5m2": "F8_E5M2", "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ", "float8_e8m0fnu": "F8_E8M0FNU",
    "float4_e2m1fn_x2": "F4_E2M1FN",
}
CUDA = torch.cuda.is_available()


def raw(t):
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def describe(t):
    name = str(t.dtype).replace("torch.", "")
    shape = list(t.shape)
    if name == "float4_e2m1fn_x2":
        shape = (shape or [1])[:-1] + [(shape or [1])[-1] * 2]
    return {"dtype": FERRY[name], "shape": shape, "sha256": hashlib.sha256(raw(t)).hexdigest()}


def flatten(obj, prefix=""):
    out = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if str(k).endswith("_extra_state"):
                continue
            out.update(flatten(v, "%s.%s" % (prefix, k) if prefix else str(k)))
    return out


def every_dtype(gen):
    out = collections.OrderedDict()
    for name in FERRY:
        dt = getattr(torch, name, None)
        if dt is None:
            continue
        bits = torch.randint(0, 256, (3, 4 * dt.itemsize), generator=gen, dtype=torch.uint8)
        if name == "bool":
            bits &= 1
        out[name] = bits.view(dt)
    return out


def te_recipe_module():
    import torch_like  # the stand-in TransformerEngine recipe classes

    return torch_like.recipe, {k: v for k, v in torch_like._FAKES.items()
                               if k.startswith("transformer_engine")}


def te_state(recipe, device, gen, num_gemms=2, history=8):
    sf, sb = 3 * num_gemms, 2 * num_gemms
    rnd = lambda *s: torch.rand(*s, generator=gen).to(device)  # noqa: E731
    return {"recipe": recipe, "scale_fwd": rnd(sf), "amax_history_fwd": rnd(history, sf),
            "scale_bwd": rnd(sb), "amax_history_bwd": rnd(history, sb),
            "extra_fp8_variables": {"num_gemms": num_gemms, "fp8_checkpoint": True}}


def expect_scaling(state):
    out = []
    for d, sfx in (("forward", "fwd"), ("backward", "bwd")):
        out.append({"direction": d, "scale": state["scale_" + sfx].cpu().tolist(),
                    "amax_history": state["amax_history_" + sfx].cpu().tolist()})
    return out


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    cases = []

    def add(name, path, obj, **extra):
        cases.append({"name": name, "path": os.path.relpath(path, out),
                      "tensors": {k: describe(v) for k, v in flatten(obj).items()}, **extra})

    # 1. Every dtype torch has that TensorFerry has, in a nested dict, plus plain values.
    dt = every_dtype(gen)
    obj = {"dtypes": dt, "step": 3, "note": "fixture"}
    torch.save(obj, os.path.join(out, "dtypes.pt"))
    add("dtypes", os.path.join(out, "dtypes.pt"), obj)

    # 2. Views: storage offsets, non-contiguous, overlapping (expand), shared storages.
    base = torch.arange(240, dtype=torch.float32).reshape(12, 20)
    views = collections.OrderedDict(
        full=base, rows=base[3:7], cols=base[:, 5:9], transposed=base.t(),
        strided=base[::3, ::2], expanded=base[0].unsqueeze(0).expand(4, 20),
        scalar=base[5, 5], shared_again=base.view(20, 12), empty=base[:0])
    torch.save(views, os.path.join(out, "views.pt"))
    add("views", os.path.join(out, "views.pt"), views)

    # 3. A pytorch_model.bin: a module's state_dict (OrderedDict with _metadata), bf16.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64),
                                torch.nn.LayerNorm(64), torch.nn.Linear(64, 16)).to(torch.bfloat16)
    sd = model.state_dict()
    torch.save(sd, os.path.join(out, "pytorch_model.bin"))
    add("pytorch_model.bin", os.path.join(out, "pytorch_model.bin"), sd)

    # 4. The same, sharded with an index.
    names = list(sd)
    shard_of = {}
    for k, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        fn = "pytorch_model-%05d-of-00002.bin" % (k + 1)
        torch.save({n: sd[n] for n in part}, os.path.join(out, fn))
        shard_of.update({n: fn for n in part})
    with open(os.path.join(out, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(v.nbytes for v in sd.values())},
                   "weight_map": shard_of}, f)
    add("sharded", os.path.join(out, "pytorch_model.bin.index.json"), sd)

    # 5. A DCP folder, one process.
    try:
        import torch.distributed.checkpoint as dcp

        dcp_sd = {k: v.clone() for k, v in sd.items()}
        dcp_dir = os.path.join(out, "dcp")
        try:
            dcp.save(dcp_sd, checkpoint_id=dcp_dir, no_dist=True)
        except TypeError:
            dcp.save(dcp_sd, storage_writer=dcp.FileSystemWriter(dcp_dir), no_dist=True)
        add("dcp", dcp_dir, dcp_sd)
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        print("make_fixtures: no DCP case: %r" % (e,), file=sys.stderr)

    # 6. TransformerEngine-style extra state, every version.
    recipe_mod, fakes = te_recipe_module()
    saved = {k: sys.modules.get(k) for k in fakes}
    sys.modules.update(fakes)
    try:
        dev = "cuda:0" if CUDA else "cpu"
        te = collections.OrderedDict()
        te["layers.0.fc1.weight"] = torch.randn(16, 16, generator=gen).to(dev, torch.bfloat16)
        scaling = {}
        forms = {
            "layers.0.fc1": "uint8 pickle, CPU tensors (TransformerEngine 2.x)",
            "layers.1.fc1": "uint8 pickle, CUDA tensors (the original bug)",
            "layers.2.fc1": "io.BytesIO of torch.save (1.x)",
            "layers.3.fc1": "dict of CUDA tensors in the state dict",
        }
        r = recipe_mod.DelayedScaling(margin=0, fp8_format=recipe_mod.Format.HYBRID,
                                      amax_history_len=8)
        st = te_state(r, "cpu", gen)
        te["layers.0.fc1._extra_state"] = torch.frombuffer(bytearray(pickle.dumps(st)),
                                                           dtype=torch.uint8)
        scaling["layers.0.fc1"] = expect_scaling(st)
        st = te_state(r, dev, gen)
        te["layers.1.fc1._extra_state"] = torch.frombuffer(bytearray(pickle.dumps(st)),
                                                           dtype=torch.uint8)
        scaling["layers.1.fc1"] = expect_scaling(st)
        st = te_state(r, dev, gen)
        b = io.BytesIO()
        torch.save(st, b)
        te["layers.2.fc1._extra_state"] = b
        scaling["layers.2.fc1"] = expect_scaling(st)
        st = te_state(r, dev, gen)
        te["layers.3.fc1._extra_state"] = st
        scaling["layers.3.fc1"] = expect_scaling(st)
        te["layers.4.norm._extra_state"] = torch.empty(0, dtype=torch.uint8)
        path = os.path.join(out, "te_cuda.pt")
        torch.save(te, path)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    scaling_expect = dict(scaling)
    add("te_cuda", path, te, scaling=scaling_expect, forms=forms,
        saved_on=dev, stateless=["layers.4.norm"])

    # 7. A legacy (non-zip) file: refused with a clear error.
    path = os.path.join(out, "legacy.pt")
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    cases.append({"name": "legacy", "path": "legacy.pt", "error": "legacy torch.save file"})

    manifest = {"torch": torch.__version__, "cuda": CUDA, "cases": cases}
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    total = sum(os.path.getsize(os.path.join(dp, fn))
                for dp, _, fns in os.walk(out) for fn in fns)
    print("make_fixtures: torch %s, cuda %s, %d cases, %d bytes in %s"
          % (torch.__version__, CUDA, len(cases), total, out))


if __name__ == "__main__":
    main()
