"""One-shot Python loads onto the GPU, each in a fresh interpreter, beside the peers installed.

    python3 benchmarks/oneshot_python.py [--reps N] [--layers 12] [--dir /dev/shm] [--keep]
    python3 benchmarks/oneshot_python.py [--reps N] FILE [FILE ...]

Without FILEs it writes a mixture-of-experts checkpoint shaped like Qwen3-30B-A3B (hidden
2048, 32 query and 4 key/value heads of 128, 128 experts of 768, bf16; per layer the q/k/v/o
projections, q/k norms, the two layer norms, the router and each expert's gate/up/down
projections) cut to --layers layers (12: 4,719 tensors, 16.2 GB; 48: the whole model, 18,867
tensors, 61.1 GB) into --dir, as a .ferry file and, where safetensors is installed, the same
tensors as a .safetensors file written by safetensors itself; the first load after the write
is reported on its own line. A FILE ending in .ferry is compared with FILE's .safetensors twin
when one lies beside it.

Every run is a new process that imports torch and creates the CUDA context (not timed), then
times one way of getting every tensor onto the current GPU up to the data being there:
    ferry             tensorferry.load_file(path, device="cuda")            (verified: default)
    ferry_noverify    the same with verify=False
    ferry_iter        tensorferry.load_iter(path): also the time to the first tensor
    safetensors       safetensors.torch.load_file(twin, device="cuda:N")
fastsafetensors and InstantTensor, the other peers, do not install without network access (the
GPU machine has none): the script says so and does not measure them. The safetensors twin is
written for up to 24 layers (safetensors' writer holds every byte in memory first).
Prints GB/s (decimal, tensor bytes) of every run and the median per mode. tensorferry runs
compare 8 tensors spread over the checkpoint with the file (a wrong load fails loudly). Set
TENSORFERRY_LIBRARY and PYTHONPATH as tests/run_all.sh does.
"""
import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

HIDDEN, HEADS, KV, HEAD_DIM, EXPERTS, INTER, VOCAB = 2048, 32, 4, 128, 128, 768, 151936


def moe_shapes(layers):
    """[(name, shape)] of the Qwen3-30B-A3B layout cut to `layers` layers."""
    out = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for layer in range(layers):
        p = "model.layers.%d." % layer
        out += [(p + "self_attn.q_proj.weight", (HEADS * HEAD_DIM, HIDDEN)),
                (p + "self_attn.k_proj.weight", (KV * HEAD_DIM, HIDDEN)),
                (p + "self_attn.v_proj.weight", (KV * HEAD_DIM, HIDDEN)),
                (p + "self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM)),
                (p + "self_attn.q_norm.weight", (HEAD_DIM,)),
                (p + "self_attn.k_norm.weight", (HEAD_DIM,)),
                (p + "input_layernorm.weight", (HIDDEN,)),
                (p + "post_attention_layernorm.weight", (HIDDEN,)),
                (p + "mlp.gate.weight", (EXPERTS, HIDDEN))]
        for e in range(EXPERTS):
            q = p + "mlp.experts.%d." % e
            out += [(q + "gate_proj.weight", (INTER, HIDDEN)),
                    (q + "up_proj.weight", (INTER, HIDDEN)),
                    (q + "down_proj.weight", (HIDDEN, INTER))]
    out += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    return out


def write_moe(layers, directory):
    """Writes the checkpoint as .ferry (and .safetensors where installed); returns the paths.
    Every tensor views one pool of weights-like values at its own offset: little memory, and
    a misplaced tensor still shows."""
    import numpy as np
    import ml_dtypes
    import tensorferry

    rng = np.random.default_rng(0)
    pool = (rng.standard_normal(VOCAB * HIDDEN + 4096, dtype=np.float32) * 0.02).astype(
        ml_dtypes.bfloat16)
    tensors = {}
    for k, (name, shape) in enumerate(moe_shapes(layers)):
        n = int(np.prod(shape))
        at = (k * 2053) % 4096
        tensors[name] = pool[at:at + n].reshape(shape)
    base = os.path.join(directory, "ferry_moe_py_%d" % layers)
    paths = [base + ".ferry"]
    t0 = time.perf_counter()
    tensorferry.save_file(tensors, paths[0], durable=False)
    print("wrote %s: %d tensors, %.2f GB in %.1f s" % (
        paths[0], len(tensors), os.path.getsize(paths[0]) / 1e9, time.perf_counter() - t0))
    if layers > 24:
        print("no safetensors twin for %d layers: its writer would hold %.0f GB in memory"
              % (layers, os.path.getsize(paths[0]) / 1e9))
    elif importlib.util.find_spec("safetensors") is not None:
        import safetensors.numpy

        t0 = time.perf_counter()
        safetensors.numpy.save_file(tensors, base + ".safetensors")
        print("wrote %s with safetensors in %.1f s" % (base + ".safetensors",
                                                       time.perf_counter() - t0))
        paths.append(base + ".safetensors")
    sys.stdout.flush()
    return paths


def check(torch, tensorferry, path, tensors):
    """Compares 8 tensors spread over the checkpoint with the file's bytes."""
    import numpy as np

    names = sorted(tensors)
    with tensorferry.Reader(path) as r:
        for name in names[::max(1, len(names) // 8)]:
            t = tensors[name]
            want = np.empty(t.numel() * t.element_size(), np.uint8)
            r.read_into(name, want.ctypes.data, want.nbytes, verify=False)
            got = t.contiguous().view(-1).view(torch.uint8).cpu().numpy()
            if not np.array_equal(got, want):
                return "MISMATCH in %s" % name
    return "ok"


def child(path, mode):
    import torch

    torch.zeros(1, device="cuda")  # the CUDA context, paid before the clock starts
    torch.cuda.synchronize()
    first = None
    note = ""
    if mode.startswith("ferry"):
        import tensorferry

        t0 = time.perf_counter()
        if mode == "ferry_iter":
            tensors = {}
            for name, t in tensorferry.load_iter(path, device="cuda"):
                if first is None and t.numel():
                    first = time.perf_counter() - t0
                tensors[name] = t
        else:
            tensors = tensorferry.load_file(path, device="cuda", verify=mode == "ferry")
        torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        note = check(torch, tensorferry, path, tensors)
    elif mode == "safetensors":
        import safetensors.torch

        t0 = time.perf_counter()
        tensors = safetensors.torch.load_file(path, device="cuda:%d" % torch.cuda.current_device())
        torch.cuda.synchronize()
        secs = time.perf_counter() - t0
    else:
        raise SystemExit("unknown mode " + mode)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    print(json.dumps({"bytes": nbytes, "seconds": secs, "first": first,
                      "tensors": len(tensors), "note": note}))


def run_child(mode, path):
    out = subprocess.run([sys.executable, __file__, "--child", "--child-mode", mode, path],
                         capture_output=True, text=True)
    if out.returncode != 0:
        return None, (out.stderr.strip() or out.stdout.strip())[-1500:]
    return json.loads(out.stdout.strip().splitlines()[-1]), None


def report(label, path, runs, firsts, notes, failure):
    if failure:
        # The row names the exception (the last line); the child's output follows it.
        print("%-16s %s: child failed: %s" % (label, path, failure.splitlines()[-1]))
        print("    " + failure.replace("\n", "\n    "))
    if runs:
        gbps = [r["bytes"] / r["seconds"] / 1e9 for r in runs]
        print("%-16s %s, %d tensors, %.2f GB: median %.1f GB/s (runs: %s)%s%s" % (
            label, os.path.basename(path), runs[0]["tensors"], runs[0]["bytes"] / 1e9,
            statistics.median(gbps), " ".join("%.1f" % g for g in gbps),
            "; first tensor %.1f ms" % statistics.median(firsts) if firsts else "",
            "; check " + ",".join(sorted(set(notes))) if any(notes) else ""))
    sys.stdout.flush()


def bench(path, modes, reps):
    for mode in modes:
        runs, firsts, notes, failure = [], [], [], None
        target = path
        if mode == "safetensors":
            target = os.path.splitext(path)[0] + ".safetensors"
            if not os.path.exists(target):
                continue
        for _ in range(reps):
            r, failure = run_child(mode, target)
            if r is None:
                break
            runs.append(r)
            notes.append(r.get("note") or "")
            if r.get("first") is not None:
                firsts.append(r["first"] * 1e3)
        report(mode, target, runs, firsts, notes, failure)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--dir", default="/dev/shm")
    ap.add_argument("--keep", action="store_true", help="keep the files written")
    ap.add_argument("--modes", default="ferry,ferry_noverify,ferry_iter,safetensors")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--child-mode", default="ferry")
    ap.add_argument("files", nargs="*")
    args = ap.parse_args()
    if args.child:
        child(args.files[0], args.child_mode)
        return
    modes = args.modes.split(",")
    for peer in ("fastsafetensors", "instanttensor"):
        print("%s: %s; not measured" % (peer, "installed, but this script does not drive it"
                                        if importlib.util.find_spec(peer) else
                                        "not installed (it does not install without network "
                                        "access)"))
    if "safetensors" in modes and importlib.util.find_spec("safetensors") is None:
        print("safetensors: not installed; not measured")
        modes.remove("safetensors")
    written = []
    files = args.files
    try:
        if not files:
            written = write_moe(args.layers, args.dir)
            files = written[:1]
            # The first process after the write: nothing has read the file since.
            r, failure = run_child("ferry", files[0])
            report("ferry 1st after write", files[0], [r] if r else [], [],
                   [r.get("note", "")] if r else [], failure)
        for path in files:
            bench(path, modes, args.reps)
    finally:
        if not args.keep:
            for p in written:
                os.unlink(p)


if __name__ == "__main__":
    main()
