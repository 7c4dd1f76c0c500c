"""A TransformerEngine-style checkpoint written on cuda:0 converts and loads on cuda:1.

    python3 tests/python/te_import_scenario.py FIXTURE_DIR WORK_DIR

FIXTURE_DIR is make_fixtures.py's output (run on a GPU machine, so te_cuda.pt holds a weight
on cuda:0 and extra state with CUDA tensors inside its pickles). Three fresh processes:
- convert: tensorferry.convert(te_cuda.pt, te.ferry); NVML must list it on no GPU;
- load: current device 1, tensorferry.torch.load_state_dict and load_te_extra_state; every
  tensor on cuda:1, the extra state's values equal what was saved, and NVML lists the
  process on GPU 1 and not on GPU 0;
- control: torch.load(te_cuda.pt) with current device 1, which NVML is expected to show on
  GPU 0 (the probe sees the failure this removes).
Prints one line per finding and "te import scenario: PASS" or "FAIL"; exit 0, 1, or 77 when
torch, pynvml or a second GPU is missing.
"""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bindings", "python"))
from seed_scenario import bus_id, nvml_report  # noqa: E402


def role_convert(fix, work, bus):
    import tensorferry

    tensorferry.convert(os.path.join(fix, "te_cuda.pt"), os.path.join(work, "te.ferry"))
    print(json.dumps({"pid": os.getpid(), "nvml": nvml_report(bus),
                      "torch_imported": "torch" in sys.modules}))


def role_load(fix, work, bus):
    import pickle

    import torch

    import tensorferry.torch as tft

    torch.cuda.set_device(1)
    path = os.path.join(work, "te.ferry")
    state = tft.load_state_dict(path)
    extra = tft.load_te_extra_state(path)
    torch.cuda.synchronize()
    devices = sorted({str(v.device) for v in list(state.values()) + list(extra.values())})
    decoded = {}
    for key, blob in extra.items():
        module = key[: -len("._extra_state")]
        if blob.numel() == 0:
            decoded[module] = None
            continue
        d = pickle.loads(blob.cpu().numpy().tobytes())  # our own bytes: CPU tensors only
        decoded[module] = {k: d[k].tolist() for k in
                           ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")}
        decoded[module]["inner_devices"] = sorted({str(d[k].device) for k in d
                                                   if isinstance(d[k], torch.Tensor)})
    print(json.dumps({"pid": os.getpid(), "devices": devices, "decoded": decoded,
                      "nvml": nvml_report(bus), "current_device": torch.cuda.current_device()}))


def role_control(fix, work, bus):
    import torch

    # TransformerEngine need not be installed: its recipe classes are stood in for (as
    # make_fixtures.py wrote them), so torch.load gets as far as the CUDA tensors.
    import torch_like

    sys.modules.update({k: v for k, v in torch_like._FAKES.items()
                        if k.startswith("transformer_engine")})
    torch.cuda.set_device(1)
    torch.load(os.path.join(fix, "te_cuda.pt"), weights_only=False)
    torch.cuda.synchronize()
    print(json.dumps({"pid": os.getpid(), "nvml": nvml_report(bus)}))


def run(role, fix, work, bus):
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--role", role, fix, work,
                        json.dumps(bus)], capture_output=True, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        raise SystemExit("te import scenario: process %s failed (exit %d)" % (role, p.returncode))
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    if sys.argv[1] == "--role":
        role, fix, work, bus = sys.argv[2:6]
        bus = {int(k): v for k, v in json.loads(bus).items()}
        return {"convert": role_convert, "load": role_load, "control": role_control}[role](
            fix, work, bus)
    fix, work = sys.argv[1], sys.argv[2]
    try:
        import pynvml  # noqa: F401
        import torch
    except ImportError as e:
        print("te import scenario: SKIP (%s)" % e)
        return 77
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("te import scenario: SKIP (needs 2 CUDA devices)")
        return 77
    with open(os.path.join(fix, "manifest.json")) as f:
        case = next(c for c in json.load(f)["cases"] if c["name"] == "te_cuda")
    bus = {0: bus_id(torch, 0), 1: bus_id(torch, 1)}
    os.makedirs(work, exist_ok=True)
    ok = True

    def check(cond, text):
        nonlocal ok
        ok = ok and cond
        print("  [%s] %s" % ("ok" if cond else "FAIL", text))

    print("checkpoint %s, saved on %s; extra state forms: %s"
          % (os.path.join(fix, "te_cuda.pt"), case["saved_on"], case["forms"]))
    check(case["saved_on"] == "cuda:0", "the checkpoint was written on cuda:0")
    c = run("convert", fix, work, bus)
    listed = [i for i, r in c["nvml"].items() if r[0]]
    print("convert pid %d: NVML lists it on GPUs %s; torch imported: %s"
          % (c["pid"], listed, c["torch_imported"]))
    check(not listed and not c["torch_imported"], "conversion touched no GPU and no torch")
    b = run("load", fix, work, bus)
    print("load pid %d: current device %d, tensors on %s" % (b["pid"], b["current_device"],
                                                             b["devices"]))
    check(b["devices"] == ["cuda:1"], "every tensor and extra state landed on cuda:1")
    same = True
    for module, want in case["scaling"].items():
        got = b["decoded"].get(module)
        same &= got is not None and got["inner_devices"] == ["cpu"]
        for w in want:
            sfx = "fwd" if w["direction"] == "forward" else "bwd"
            same &= got is not None and got["scale_" + sfx] == w["scale"] and \
                got["amax_history_" + sfx] == w["amax_history"]
    for module in case.get("stateless", []):
        same &= b["decoded"].get(module, "missing") is None
    check(same, "extra state of %d modules equals what was saved, bit for bit (CPU tensors "
          "inside the rebuilt pickles)" % len(case["scaling"]))
    on0, _, dev0, pids0 = b["nvml"]["0"]
    on1, mib1, _, pids1 = b["nvml"]["1"]
    print("  NVML GPU 0: pids %s (device used %.0f MiB); GPU 1: pids %s, load uses %.0f MiB"
          % (pids0, dev0, pids1, mib1))
    check(on1, "NVML lists the loading process on GPU 1 (the probe sees it)")
    check(not on0, "NVML lists nothing for the loading process on GPU 0")
    k = run("control", fix, work, bus)
    print("control pid %d (torch.load of te_cuda.pt, current device 1): NVML lists it on "
          "GPU 0: %s (%.0f MiB)" % (k["pid"], k["nvml"]["0"][0], k["nvml"]["0"][1]))
    check(k["nvml"]["0"][0], "the probe detects the old failure (control)")
    print("te import scenario: %s" % ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
