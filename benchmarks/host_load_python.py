"""Host (CPU) loads from Python of one llama-like checkpoint, TensorFerry beside safetensors on
the same tensors, same machine, same run, files in the page cache.

    python3 benchmarks/host_load_python.py [--gib 2] [--dir /dev/shm] [--reps 5] [--torch]

Writes the same bf16 tensors (a llama-like decoder of about --gib GiB) as one .safetensors
file (with safetensors' own writer) and one raw .ferry file, reads both into the page cache,
then times each way of getting every tensor into host memory and touching every page of it
(one byte per 4 KiB, so lazily mapped tensors pay their page faults inside the clock):

    numpy   safetensors.numpy.load_file / tensorferry.load_file (of the .ferry file and of the
            .safetensors file itself) / safe_open + get_tensor for every name, both libraries
    torch   (--torch) safetensors.torch.load_file / tensorferry.torch.load_file(device="cpu")
            / safe_open(framework="pt") + get_tensor, both libraries

Prints the median and best of --reps runs in GB/s (decimal, tensor bytes) and each TensorFerry
row's ratio to the safetensors row of the same kind. Set TENSORFERRY_LIBRARY and PYTHONPATH as
tests/run_all.sh does.
"""
import argparse
import gc
import os
import statistics
import time

import numpy as np


def llama_like(gib):
    """{name: bf16 array} of about `gib` GiB: hidden 2048, ffn 5632, kv 512, 32000 vocab."""
    import ml_dtypes

    h, ffn, kv, vocab = 2048, 5632, 512, 32000
    layer = 2 * (2 * h * h + 2 * kv * h + 3 * ffn * h + 2 * h)
    embed = 2 * 2 * vocab * h
    layers = max(1, int((gib * 2 ** 30 - embed) // layer))
    shapes = {"model.embed_tokens.weight": (vocab, h), "lm_head.weight": (vocab, h),
              "model.norm.weight": (h,)}
    for i in range(layers):
        p = "model.layers.%d." % i
        shapes.update({p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (h, h),
                       p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h),
                       p + "self_attn.o_proj.weight": (h, h),
                       p + "post_attention_layernorm.weight": (h,),
                       p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
                       p + "mlp.down_proj.weight": (h, ffn)})
    rng = np.random.default_rng(0)
    pattern = rng.integers(0, 65536, size=1 << 22, dtype=np.uint16)
    out = {}
    for k, (name, shape) in enumerate(sorted(shapes.items())):
        n = int(np.prod(shape))
        reps = -(-n // pattern.size)
        data = np.roll(np.tile(pattern, reps)[:n], k)
        out[name] = data.view(ml_dtypes.bfloat16).reshape(shape)
    return out


def touch(tensors):
    """One byte of every 4 KiB of every tensor: pages mapped lazily are faulted in here."""
    s = 0
    for t in tensors.values():
        if hasattr(t, "numpy"):
            t = t.view(-1).view(__import__("torch").uint8).numpy()
        else:
            t = t.reshape(-1).view(np.uint8)
        s += int(t[::4096].sum())
    return s


def warm(path):
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def run(label, fn, reps, nbytes):
    secs = []
    for _ in range(reps):
        gc.collect()
        t0 = time.perf_counter()
        tensors = fn()
        touch(tensors)
        secs.append(time.perf_counter() - t0)
        del tensors
    med, best = statistics.median(secs), min(secs)
    print("%-58s median %6.2f GB/s  best %6.2f GB/s  (%.3f s)" % (
        label, nbytes / med / 1e9, nbytes / best / 1e9, med), flush=True)
    return med


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=2)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--torch", action="store_true", help="also the torch CPU loads")
    args = ap.parse_args()

    import safetensors
    import safetensors.numpy
    import tensorferry

    tensors = llama_like(args.gib)
    nbytes = sum(t.nbytes for t in tensors.values())
    base = os.path.join(args.dir, "ferry_host_%d" % os.getpid())
    fpath, spath = base + ".ferry", base + ".safetensors"
    try:
        safetensors.numpy.save_file(tensors, spath)
        tensorferry.save_file(tensors, fpath, durable=False)
        del tensors
        warm(fpath)
        warm(spath)
        print("checkpoint  %d tensors, %.2f GiB bf16, %d CPUs, safetensors %s, tensorferry %s"
              % (len(tensorferry.Reader(fpath).keys()), nbytes / 2 ** 30, os.cpu_count(),
                 safetensors.__version__, tensorferry.version()), flush=True)

        def loop(open_fn, path, **kw):
            def go():
                with open_fn(path, **kw) as f:
                    return {k: f.get_tensor(k) for k in f.keys()}
            return go

        rows = [
            ("numpy: safetensors.numpy.load_file", lambda: safetensors.numpy.load_file(spath),
             None),
            ("numpy: tensorferry.load_file (.ferry)", lambda: tensorferry.load_file(fpath), 0),
            ("numpy: tensorferry.load_file (the .safetensors file)",
             lambda: tensorferry.load_file(spath), 0),
            ("numpy: safetensors safe_open + get_tensor each",
             loop(safetensors.safe_open, spath, framework="np"), None),
            ("numpy: tensorferry safe_open + get_tensor each",
             loop(tensorferry.safe_open, fpath, framework="np"), 3),
        ]
        if args.torch:
            import safetensors.torch
            import tensorferry.torch

            rows += [
                ("torch cpu: safetensors.torch.load_file",
                 lambda: safetensors.torch.load_file(spath, device="cpu"), None),
                ("torch cpu: tensorferry.torch.load_file (.ferry)",
                 lambda: tensorferry.torch.load_file(fpath, device="cpu"), 5),
                ("torch cpu: tensorferry.torch.load_file (the .safetensors file)",
                 lambda: tensorferry.torch.load_file(spath, device="cpu"), 5),
                ("torch cpu: safetensors safe_open(pt) + get_tensor each",
                 loop(safetensors.safe_open, spath, framework="pt", device="cpu"), None),
                ("torch cpu: tensorferry safe_open(pt) + get_tensor each",
                 loop(tensorferry.safe_open, fpath, framework="pt", device="cpu"), 8),
            ]
        times = []
        for label, fn, ref in rows:
            med = run(label, fn, args.reps, nbytes)
            times.append(med)
            if ref is not None:
                print("%-58s %.2fx safetensors' time" % ("", med / times[ref]), flush=True)
    finally:
        for p in (fpath, spath):
            if os.path.exists(p):
                os.unlink(p)


if __name__ == "__main__":
    main()
