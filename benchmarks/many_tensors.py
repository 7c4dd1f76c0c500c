"""Many small tensors from Python: open + keys() and load_file to the host, TensorFerry beside
safetensors on the same tensors, same machine, same run.

    python3 benchmarks/many_tensors.py [--tensors 100000] [--dir /dev/shm] [--reps 5]

Writes one .ferry and one .safetensors file holding the same tensors (names shaped like a
mixture-of-experts model's, two bf16 values each, as format_bench's 100,000-tensor file), then
times each operation in this process with the files in the page cache and prints the median
and best of the repetitions. Set TENSORFERRY_LIBRARY and PYTHONPATH as tests/run_all.sh does.
"""
import argparse
import gc
import os
import statistics
import time

import numpy as np


def timed(fn, reps):
    out = []
    for _ in range(reps):
        gc.collect()
        t0 = time.perf_counter()
        result = fn()
        out.append(time.perf_counter() - t0)
        del result
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, default=100000)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()

    import tensorferry
    import safetensors
    import safetensors.numpy

    import ml_dtypes

    tensors = {}
    for i in range(args.tensors):
        name = "model.layers.%d.experts.%d.mlp.down_proj.weight" % (i // 128, i % 128)
        tensors[name] = np.array([i & 0xFFFF, i >> 16], np.uint16).view(ml_dtypes.bfloat16)
    base = os.path.join(args.dir, "ferry_many_%d" % os.getpid())
    fpath, spath = base + ".ferry", base + ".safetensors"
    try:
        tensorferry.save_file(tensors, fpath, durable=False)
        safetensors.numpy.save_file(tensors, spath)
        del tensors
        for p in (fpath, spath):  # into the page cache
            with open(p, "rb") as f:
                while f.read(1 << 24):
                    pass

        def ferry_open_keys():
            r = tensorferry.Reader(fpath)
            k = r.keys()
            r.close()
            return k

        def st_open_keys():
            with safetensors.safe_open(spath, framework="np") as f:
                return f.keys()

        def ferry_load():
            return tensorferry.load_file(fpath)

        def st_load():
            return safetensors.numpy.load_file(spath)

        # Same result from both, bit for bit.
        a, b = ferry_load(), st_load()
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            assert a[k].tobytes() == b[k].tobytes(), k
        del a, b

        rows = [
            ("open + keys()", timed(ferry_open_keys, args.reps), timed(st_open_keys, args.reps)),
            ("load_file (numpy, host)", timed(ferry_load, args.reps), timed(st_load, args.reps)),
        ]
        print("%d tensors, %s; %.1f MiB .ferry, %.1f MiB .safetensors; tensorferry %s, "
              "safetensors %s; %d CPUs" % (args.tensors, args.dir, os.path.getsize(fpath) / 2**20,
                                          os.path.getsize(spath) / 2**20, tensorferry.version(),
                                          safetensors.__version__, os.cpu_count()))
        print("%-26s %22s %22s %8s" % ("operation", "tensorferry ms", "safetensors ms",
                                        "speedup"))
        print("%-26s %22s %22s %8s" % ("", "median (best)", "median (best)", ""))
        for name, f, s in rows:
            fm, sm = statistics.median(f), statistics.median(s)
            print("%-26s %13.1f (%6.1f) %13.1f (%6.1f) %7.2fx" % (
                name, fm * 1e3, min(f) * 1e3, sm * 1e3, min(s) * 1e3, sm / fm))
    finally:
        for p in (fpath, spath):
            if os.path.exists(p):
                os.unlink(p)


if __name__ == "__main__":
    main()
