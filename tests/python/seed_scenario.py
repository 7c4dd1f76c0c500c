"""The seed scenario from Python, on a machine with 2 GPUs.

Process A (current device 0) saves a model's state_dict and FP8 scaling state whose tensors
live on cuda:0. Process B sets current device 1 and loads the checkpoint with
tensorferry.torch. NVML must show B's PID on GPU 1 and not on GPU 0, and every tensor must
land on cuda:1. As a control that the probe can see the failure, process C does what
checkpoints did before (torch.load of a pickled checkpoint from cuda:0) with current device 1,
and NVML is expected to show C on GPU 0.

    python3 tests/python/seed_scenario.py [--dir DIR] [--no-baseline]

Prints one line per finding and "seed scenario: PASS" or "FAIL"; exits 0 on pass, 1 on
failure, 77 when the machine lacks torch, pynvml or two GPUs.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bindings", "python"))


def bus_id(torch, index):
    p = torch.cuda.get_device_properties(index)
    return "%08x:%02x:%02x.0" % (p.pci_domain_id, p.pci_bus_id, p.pci_device_id)


def nvml_report(bus_ids):
    """{cuda index: (pid listed, MiB used by this pid, MiB used on the device)} via NVML."""
    import pynvml

    pynvml.nvmlInit()
    try:
        out = {}
        me = os.getpid()
        for index, bid in bus_ids.items():
            h = pynvml.nvmlDeviceGetHandleByPciBusId(bid.encode())
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
            mine = [p for p in procs if p.pid == me]
            used = sum((p.usedGpuMemory or 0) for p in mine) / 2**20
            dev_used = pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**20
            out[index] = (bool(mine), used, dev_used, [p.pid for p in procs])
        return out
    finally:
        pynvml.nvmlShutdown()


def role_save(d):
    import torch

    import tensorferry.torch as tft

    torch.cuda.set_device(0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                torch.nn.Linear(4096, 1024)).to(torch.bfloat16).cuda()
    scaling = {
        name: {"recipe": {"type": "DelayedScaling", "fp8_format": "HYBRID",
                          "amax_history_len": 16},
               "states": [{"direction": "forward", "slot_roles": ["input", "weight", "output"],
                           "scale": torch.rand(3, device="cuda:0"),
                           "amax_history": torch.rand(16, 3, device="cuda:0")},
                          {"direction": "backward", "slot_roles": ["grad_output", "grad_input"],
                           "scale": torch.rand(2, device="cuda:0"),
                           "amax_history": torch.rand(16, 2, device="cuda:0")}]}
        for name in ("0", "2")
    }
    tft.save_state_dict(model, os.path.join(d, "ckpt.ferry"), scaling_state=scaling,
                        metadata={"saved_on": "cuda:0"})
    # What checkpoints used to hold: CUDA tensors pickled with their device index.
    torch.save({"model": model.state_dict(), "fp8": scaling}, os.path.join(d, "ckpt.pt"))
    sums = {k: float(v.float().sum()) for k, v in model.state_dict().items()}
    sums.update({"%s.%d.scale" % (m, i): float(s["scale"].sum())
                 for m, e in scaling.items() for i, s in enumerate(e["states"])})
    print(json.dumps({"pid": os.getpid(), "bus": {0: bus_id(torch, 0), 1: bus_id(torch, 1)},
                      "sums": sums}))


def role_load(d, bus):
    import torch

    import tensorferry.torch as tft

    torch.cuda.set_device(1)
    state = tft.load_state_dict(os.path.join(d, "ckpt.ferry"))
    fp8 = tft.load_scaling_state(os.path.join(d, "ckpt.ferry"))
    torch.cuda.synchronize()
    devices = sorted({str(v.device) for v in state.values()} |
                     {str(s[k].device) for e in fp8.values() for s in e["states"]
                      for k in ("scale", "amax_history")})
    sums = {k: float(v.float().sum()) for k, v in state.items()}
    sums.update({"%s.%d.scale" % (m, i): float(s["scale"].sum())
                 for m, e in fp8.items() for i, s in enumerate(e["states"])})
    report = nvml_report({int(k): v for k, v in bus.items()})
    print(json.dumps({"pid": os.getpid(), "devices": devices, "sums": sums, "nvml": report,
                      "current_device": torch.cuda.current_device()}))


def role_baseline(d, bus):
    import torch

    torch.cuda.set_device(1)
    obj = torch.load(os.path.join(d, "ckpt.pt"))  # restores each tensor on its saved device
    torch.cuda.synchronize()
    devices = sorted({str(v.device) for v in obj["model"].values()})
    report = nvml_report({int(k): v for k, v in bus.items()})
    print(json.dumps({"pid": os.getpid(), "devices": devices, "nvml": report}))


def run(role, d, bus=None):
    cmd = [sys.executable, os.path.abspath(__file__), "--role", role, "--dir", d]
    if bus is not None:
        cmd += ["--bus", json.dumps(bus)]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        raise SystemExit("seed scenario: process %s failed (exit %d)" % (role, p.returncode))
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=["save", "load", "baseline"])
    ap.add_argument("--dir")
    ap.add_argument("--bus")
    ap.add_argument("--no-baseline", action="store_true")
    args = ap.parse_args()
    if args.role == "save":
        return role_save(args.dir)
    if args.role == "load":
        return role_load(args.dir, json.loads(args.bus))
    if args.role == "baseline":
        return role_baseline(args.dir, json.loads(args.bus))

    try:
        import pynvml  # noqa: F401
        import torch
    except ImportError as e:
        print("seed scenario: SKIP (%s)" % e)
        return 77
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("seed scenario: SKIP (needs 2 CUDA devices)")
        return 77

    d = args.dir or tempfile.mkdtemp(prefix="ferry_seed_")
    os.makedirs(d, exist_ok=True)
    a = run("save", d)
    print("A pid %d: saved %s from cuda:0 (%d tensors + FP8 state); GPU bus ids %s"
          % (a["pid"], os.path.join(d, "ckpt.ferry"), len(a["sums"]) - 4, a["bus"]))
    b = run("load", d, a["bus"])
    ok = True

    def check(cond, text):
        nonlocal ok
        ok = ok and cond
        print("  [%s] %s" % ("ok" if cond else "FAIL", text))

    print("B pid %d: current device %d, tensors on %s" % (b["pid"], b["current_device"],
                                                           b["devices"]))
    check(b["devices"] == ["cuda:1"], "every tensor and scale landed on cuda:1")
    same = sorted(b["sums"]) == sorted(a["sums"]) and all(
        abs(b["sums"][k] - v) <= 1e-3 * max(1.0, abs(v)) for k, v in a["sums"].items())
    check(same, "values equal what A saved (%d sums)" % len(a["sums"]))
    on0, mib0, dev0, pids0 = b["nvml"]["0"]
    on1, mib1, dev1, pids1 = b["nvml"]["1"]
    print("  NVML GPU 0: pids %s, device used %.0f MiB; GPU 1: pids %s, B uses %.0f MiB"
          % (pids0, dev0, pids1, mib1))
    check(on1, "NVML lists B on GPU 1 (the probe sees this process)")
    check(not on0, "NVML lists no entry for B on GPU 0")

    if not args.no_baseline:
        c = run("baseline", d, a["bus"])
        c_on0 = c["nvml"]["0"][0]
        print("control C pid %d (torch.load of the pickled checkpoint, current device 1): "
              "tensors on %s, NVML lists C on GPU 0: %s (%.0f MiB)"
              % (c["pid"], c["devices"], c_on0, c["nvml"]["0"][1]))
        check(c_on0, "the probe detects the old failure (control)")

    print("seed scenario: %s" % ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
