"""Side-by-side save benchmark: one state dict of weights-like bf16 on the current GPU, saved by
TensorFerry (save_file, save_file_async, raw and shuffle+zstd) and by the savers users would
pick instead (torch.save, safetensors.torch.save_file, torch.distributed.checkpoint save and
async_save), to the same directory, in the same run. Every saver ends with its file(s) fsynced
(the durable time); asynchronous savers also report when the call returned.

    python3 benchmarks/compare/save_compare.py [--gib 8] [--dir /var/tmp] [--csv FILE]
        [--skip name,name] [--reps 1]

Prints one table (GB/s of uncompressed state-dict bytes; "returned" is the time until an
asynchronous call gave control back). Peers that are not installed are skipped.
"""

import argparse
import os
import shutil
import sys
import time


def fsync_tree(path):
    paths = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path)
                                                   for f in fs]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    d = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(d)
    finally:
        os.close(d)


def remove(path):
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


def state_dict(torch, gib, device):
    n = 64
    numel = int(gib * (1 << 30)) // 2 // n
    g = torch.Generator(device=device).manual_seed(0)
    sd = {}
    for i in range(n):
        sd["layers.%d.weight" % i] = (torch.randn(numel, generator=g, device=device) * 0.02).to(
            torch.bfloat16)
        for k in range(4):
            sd["layers.%d.norm%d" % (i, k)] = torch.ones(4096, device=device, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    return sd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=8)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--csv", default="")
    ap.add_argument("--skip", default="")
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args()
    import torch

    import tensorferry as tf

    if not torch.cuda.is_available():
        print("save_compare needs a GPU; skipped")
        return 77
    device = torch.device("cuda", torch.cuda.current_device())
    sd = state_dict(torch, args.gib, device)
    total = sum(t.numel() * t.element_size() for t in sd.values())
    print("state dict: %d tensors, %.2f GiB bf16 on %s; target %s" % (len(sd), total / 2**30,
                                                                      device, args.dir))
    skip = set(s for s in args.skip.split(",") if s)
    pool = tf.StagingPool(total + (64 << 20), pin=True)  # once, as a training job would
    savers = []

    def tf_sync(enc):
        def run(path):
            tf.save_file(sd, path, encoding=enc)
            return None
        return run

    def tf_async(enc):
        def run(path):
            fut = tf.save_file_async(sd, path, encoding=enc, staging=pool)
            returned = time.perf_counter()
            fut.result()
            return returned
        return run

    savers.append(("tensorferry save_file raw", tf_sync("raw"), ".ferry"))
    savers.append(("tensorferry save_file_async raw", tf_async("raw"), ".ferry"))
    savers.append(("tensorferry save_file shuffle_zstd", tf_sync("shuffle_zstd"), ".ferry"))
    savers.append(("tensorferry save_file_async shuffle_zstd", tf_async("shuffle_zstd"),
                   ".ferry"))

    def torch_save(path):
        torch.save(sd, path)
        fsync_tree(path)

    savers.append(("torch.save", torch_save, ".pt"))
    try:
        import safetensors.torch as st

        def st_save(path):
            st.save_file(sd, path)
            fsync_tree(path)

        savers.append(("safetensors save_file", st_save, ".safetensors"))
    except ImportError:
        print("safetensors not installed: skipped")
    try:
        import torch.distributed.checkpoint as dcp

        def dcp_save(path):
            dcp.save(sd, checkpoint_id=path)
            fsync_tree(path)

        def dcp_async(path):
            fut = dcp.async_save(sd, checkpoint_id=path)
            returned = time.perf_counter()
            fut.result()
            fsync_tree(path)
            return returned

        savers.append(("torch.distributed.checkpoint save", dcp_save, ".dcp"))
        savers.append(("torch.distributed.checkpoint async_save", dcp_async, ".dcp"))
    except ImportError:
        print("torch.distributed.checkpoint not available: skipped")

    results = []
    for name, run, ext in savers:
        if name in skip:
            continue
        for rep in range(args.reps):
            path = os.path.join(args.dir, "save_compare" + ext)
            remove(path)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                returned = run(path)
            except Exception as e:  # a peer's failure is a row, not the end of the run
                print("%-44s FAILED: %s" % (name, e))
                break
            durable = time.perf_counter() - t0
            size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path)
                       for f in fs) if os.path.isdir(path) else os.path.getsize(path)
            ret = (returned - t0) if returned else None
            results.append((name, total / durable / 1e9,
                            total / ret / 1e9 if ret else None, total / size))
            print("%-44s durable %6.2f GB/s%s  (file %.2f GiB)" % (
                name, total / durable / 1e9,
                "  returned %7.2f GB/s" % (total / ret / 1e9) if ret else "", size / 2**30))
            sys.stdout.flush()
            remove(path)
    pool.close()
    print("\n%-44s %10s %10s %7s" % ("saver (GPU state dict -> %s)" % args.dir, "durable",
                                     "returned", "ratio"))
    for name, dur, ret, ratio in results:
        print("%-44s %10.2f %10s %7.2f" % (name, dur, "%.2f" % ret if ret else "-", ratio))
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("saver,durable_gbps,returned_gbps,ratio\n")
            for name, dur, ret, ratio in results:
                f.write("%s,%.3f,%s,%.3f\n" % (name, dur, "%.3f" % ret if ret else "", ratio))
    return 0


if __name__ == "__main__":
    sys.exit(main())
