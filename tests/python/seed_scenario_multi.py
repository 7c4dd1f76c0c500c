"""The original report at full scale: one process with current device 0 writes a checkpoint that
includes FP8 scaling state; then N processes, process i with current device i and no
CUDA_VISIBLE_DEVICES restriction, load it at the same time. NVML must list every loading
process on its own GPU only (in particular nothing of processes 1..N-1 on GPU 0), all tensors
must be bit-exact, and per-process and aggregate load throughput are printed.

    python3 tests/python/seed_scenario_multi.py [--procs N] [--gib 2] [--dir DIR]

N defaults to every visible GPU (8 on an 8-GPU host). Exits 0 on pass, 1 on failure, 77 when
torch, pynvml or two GPUs are missing.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bindings", "python"))


def bus_id(torch, index):
    p = torch.cuda.get_device_properties(index)
    return "%08x:%02x:%02x.0" % (p.pci_domain_id, p.pci_bus_id, p.pci_device_id)


def fingerprint(torch, t):
    """An exact, position-sensitive integer digest computed on the tensor's own device."""
    flat = t.reshape(-1)
    if flat.element_size() == 2:
        words = flat.view(torch.int16).to(torch.int64)
    elif flat.element_size() == 4:
        words = flat.view(torch.int32).to(torch.int64)
    else:
        words = flat.view(torch.uint8).to(torch.int64)
    weights = torch.arange(words.numel(), device=t.device, dtype=torch.int64) % 65521 + 1
    return int((words * weights).sum().item())


def model_state(torch, gib):
    """A llama-like stack of bf16 layers of about `gib` GiB, deterministic from a seed."""
    g = torch.Generator(device="cuda:0")
    g.manual_seed(1234)
    hidden, ffn = 4096, 11008
    per_layer = (4 * hidden * hidden + 3 * hidden * ffn) * 2
    layers = max(1, int(gib * 2**30 // per_layer))
    state = {}
    for i in range(layers):
        p = "layers.%d." % i
        for name, shape in (("attn.qkv.weight", (3 * hidden, hidden)),
                            ("attn.o.weight", (hidden, hidden)),
                            ("mlp.fc1.weight", (2 * ffn, hidden)),
                            ("mlp.fc2.weight", (hidden, ffn)),
                            ("norm.weight", (hidden,))):
            state[p + name] = torch.randn(shape, generator=g, device="cuda:0",
                                          dtype=torch.float32).to(torch.bfloat16)
    # FP8 weights with their scales, as TransformerEngine keeps them.
    w = torch.randn((hidden, hidden), generator=g, device="cuda:0")
    state["layers.0.fp8.weight"] = w.to(torch.float8_e4m3fn)
    state["layers.0.fp8.weight_scale_inv"] = torch.rand(1, generator=g, device="cuda:0")
    return state


def scaling_state(torch):
    g = torch.Generator(device="cuda:0")
    g.manual_seed(99)
    return {
        "layers.%d" % i: {
            "recipe": {"type": "DelayedScaling", "fp8_format": "HYBRID", "margin": 0,
                       "amax_history_len": 1024, "amax_compute_algo": "max"},
            "states": [
                {"direction": "forward", "slot_roles": ["input", "weight", "output"],
                 "scale": torch.rand(3, generator=g, device="cuda:0"),
                 "amax_history": torch.rand(1024, 3, generator=g, device="cuda:0")},
                {"direction": "backward", "slot_roles": ["grad_output", "grad_input"],
                 "scale": torch.rand(2, generator=g, device="cuda:0"),
                 "amax_history": torch.rand(1024, 2, generator=g, device="cuda:0")},
            ]}
        for i in range(4)
    }


def role_save(d, gib):
    import torch

    import tensorferry.torch as tft

    torch.cuda.set_device(0)
    state = model_state(torch, gib)
    fp8 = scaling_state(torch)
    path = os.path.join(d, "ckpt.ferry")
    tft.save_state_dict(state, path, scaling_state=fp8, metadata={"saved_on": "cuda:0"})
    digests = {k: fingerprint(torch, v) for k, v in state.items()}
    for m, e in fp8.items():
        for j, s in enumerate(e["states"]):
            digests["%s/%d/scale" % (m, j)] = fingerprint(torch, s["scale"])
            digests["%s/%d/amax_history" % (m, j)] = fingerprint(torch, s["amax_history"])
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    print(json.dumps({"pid": os.getpid(), "path": path, "bytes": nbytes, "digests": digests,
                      "bus": {i: bus_id(torch, i) for i in range(torch.cuda.device_count())}}))


def role_load(path, device, start_at, bus):
    import torch

    import tensorferry.torch as tft

    torch.cuda.set_device(device)
    torch.cuda.init()
    while time.time() < start_at:  # every loader starts together
        time.sleep(0.001)
    t0 = time.time()
    state = tft.load_state_dict(path)
    fp8 = tft.load_scaling_state(path)
    torch.cuda.synchronize()
    t1 = time.time()
    devices = sorted({str(v.device) for v in state.values()} |
                     {str(s[k].device) for e in fp8.values() for s in e["states"]
                      for k in ("scale", "amax_history")})
    digests = {k: fingerprint(torch, v) for k, v in state.items()}
    for m, e in fp8.items():
        for j, s in enumerate(e["states"]):
            digests["%s/%d/scale" % (m, j)] = fingerprint(torch, s["scale"])
            digests["%s/%d/amax_history" % (m, j)] = fingerprint(torch, s["amax_history"])
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    import pynvml

    pynvml.nvmlInit()
    seen = {}
    try:
        for index, bid in bus.items():
            h = pynvml.nvmlDeviceGetHandleByPciBusId(bid.encode())
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if p.pid == os.getpid():
                    seen[index] = (p.usedGpuMemory or 0) / 2**20
    finally:
        pynvml.nvmlShutdown()
    print(json.dumps({"pid": os.getpid(), "device": device, "start": t0, "end": t1,
                      "bytes": nbytes, "devices": devices, "digests": digests, "nvml": seen,
                      "current_device": torch.cuda.current_device()}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["save", "load"])
    ap.add_argument("--dir")
    ap.add_argument("--procs", type=int, default=0)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--path")
    ap.add_argument("--device", type=int)
    ap.add_argument("--start-at", type=float)
    ap.add_argument("--bus")
    args = ap.parse_args()
    if args.role == "save":
        return role_save(args.dir, args.gib)
    if args.role == "load":
        return role_load(args.path, args.device, args.start_at, json.loads(args.bus))

    try:
        import pynvml  # noqa: F401
        import torch
    except ImportError as e:
        print("seed scenario (multi): SKIP (%s)" % e)
        return 77
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < 2:
        print("seed scenario (multi): SKIP (needs 2 or more CUDA devices, found %d)" % count)
        return 77
    procs = args.procs or count
    if procs > count:
        print("seed scenario (multi): asked for %d processes, only %d GPUs" % (procs, count))
        return 1
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)  # every process sees every GPU, as in the report
    d = args.dir or tempfile.mkdtemp(prefix="ferry_seed_multi_", dir="/dev/shm"
                                     if os.path.isdir("/dev/shm") else None)
    os.makedirs(d, exist_ok=True)
    me = [sys.executable, os.path.abspath(__file__)]
    p = subprocess.run(me + ["--role", "save", "--dir", d, "--gib", str(args.gib)],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        return 1
    saved = json.loads(p.stdout.strip().splitlines()[-1])
    print("writer pid %d (current device 0): %s, %.2f GiB, %d tensors + FP8 scaling state of "
          "4 modules" % (saved["pid"], saved["path"], saved["bytes"] / 2**30,
                         len([k for k in saved["digests"] if "/" not in k])))
    start_at = time.time() + 8.0  # room for every process to start python and CUDA
    children = [subprocess.Popen(me + ["--role", "load", "--path", saved["path"], "--device",
                                       str(i), "--start-at", str(start_at), "--bus",
                                       json.dumps(saved["bus"])],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=env)
                for i in range(procs)]
    results = []
    ok = True
    for i, c in enumerate(children):
        out, err = c.communicate()
        if c.returncode != 0:
            sys.stderr.write(err)
            print("  [FAIL] loader on device %d exited %d" % (i, c.returncode))
            ok = False
            continue
        results.append(json.loads(out.strip().splitlines()[-1]))
    for r in sorted(results, key=lambda r: r["device"]):
        dev = r["device"]
        exact = r["digests"] == saved["digests"]
        only_own = sorted(r["nvml"]) == [str(dev)]
        placed = r["devices"] == ["cuda:%d" % dev] and r["current_device"] == dev
        gbps = r["bytes"] / (r["end"] - r["start"]) / 1e9
        ok = ok and exact and only_own and placed
        print("  [%s] process %d pid %d: %.2f GB/s, tensors on %s, bit-exact %s, NVML lists it "
              "on GPUs %s" % ("ok" if exact and only_own and placed else "FAIL", dev, r["pid"],
                             gbps, r["devices"], exact,
                             {k: "%.0f MiB" % v for k, v in sorted(r["nvml"].items())}))
    if results:
        span = max(r["end"] for r in results) - min(r["start"] for r in results)
        total = sum(r["bytes"] for r in results)
        print("aggregate: %d processes loaded %.2f GiB in %.3f s = %.1f GB/s"
              % (len(results), total / 2**30, span, total / span / 1e9))
        on0 = [r["device"] for r in results if r["device"] != 0 and "0" in r["nvml"]]
        print("  [%s] no process other than process 0 appears on GPU 0 (offenders: %s)"
              % ("ok" if not on0 else "FAIL", on0))
        ok = ok and not on0
    ok = ok and len(results) == procs
    print("seed scenario (multi, %d processes): %s" % (procs, "PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
