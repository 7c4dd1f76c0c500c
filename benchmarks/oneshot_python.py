"""One-shot Python loads onto the GPU, each in a fresh interpreter.

    python3 benchmarks/oneshot_python.py [--reps N] FILE [FILE ...]

For every file and repetition a new process imports torch, creates the CUDA context (not
timed), then times tensorferry.load_file(path, device="cuda") up to the data being on the
device; and the same with the streaming tensorferry.load_iter, whose first tensor gives the
time to first tensor. Prints GB/s (decimal, tensor bytes) per run and the median per file. Set
TENSORFERRY_LIBRARY and PYTHONPATH as tests/run_all.sh does.
"""
import argparse
import json
import statistics
import subprocess
import sys
import time


def child(path, mode):
    import torch
    import tensorferry

    torch.zeros(1, device="cuda")  # the CUDA context, paid before the clock starts
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    first = None
    if mode == "iter":
        tensors = {}
        for name, t in tensorferry.load_iter(path, device="cuda"):
            if first is None and t.numel():
                first = time.perf_counter() - t0
            tensors[name] = t
    else:
        tensors = tensorferry.load_file(path, device="cuda")
    torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    print(json.dumps({"bytes": nbytes, "seconds": secs, "first": first,
                      "tensors": len(tensors)}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--child-mode", default="file")
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    if args.child:
        child(args.files[0], args.child_mode)
        return
    for path in args.files:
        for mode, what in (("file", "load_file(device='cuda')"),
                           ("iter", "load_iter(device='cuda')")):
            runs, firsts = [], []
            for _ in range(args.reps):
                out = subprocess.run([sys.executable, __file__, "--child", "--child-mode", mode,
                                      path], capture_output=True, text=True)
                if out.returncode != 0:
                    print("%s: child failed: %s" % (path, out.stderr.strip()[-2000:]))
                    break
                r = json.loads(out.stdout.strip().splitlines()[-1])
                runs.append(r["bytes"] / r["seconds"] / 1e9)
                if r.get("first") is not None:
                    firsts.append(r["first"] * 1e3)
            if runs:
                print("python %s, fresh process, %s: median %.1f GB/s (runs: %s)%s" % (
                    what, path, statistics.median(runs), " ".join("%.1f" % g for g in runs),
                    "; first tensor %.1f ms (median)" % statistics.median(firsts)
                    if firsts else ""))


if __name__ == "__main__":
    main()
