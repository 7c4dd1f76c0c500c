"""tensorferry.torch.load_model into a real torch.nn.Module on cuda:1, in a process whose
current device is 1: the weights must land in the module's own tensors on cuda:1, the module
must compute what the saved one computes, and NVML must show this process on GPU 1 only.

    python3 load_model_scenario.py SCRATCH_DIR      exit 0: pass; 77: fewer than 2 GPUs
"""

import os
import subprocess
import sys

import torch

import tensorferry.torch as tft



def nvml_processes(pid):
    """{PCI bus id (last 12 characters, lower case): pid has a context there}, from NVML."""
    import pynvml

    pynvml.nvmlInit()
    try:
        out = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            bus = pynvml.nvmlDeviceGetPciInfo(h).busId
            bus = bus.decode() if isinstance(bus, bytes) else bus
            pids = [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
            out[bus.lower()[-12:]] = pid in pids
        return out
    finally:
        pynvml.nvmlShutdown()


def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Embedding(1000, 256),
        torch.nn.TransformerEncoderLayer(256, 8, 1024, batch_first=True),
        torch.nn.LayerNorm(256),
        torch.nn.Linear(256, 1000, bias=False),
    )
    model[3].weight = model[0].weight  # tied input and output embeddings
    return model.eval()


def main():
    scratch = sys.argv[1]
    if torch.cuda.device_count() < 2:
        print("fewer than 2 GPUs: skipped")
        return 77
    path = os.path.join(scratch, "model.ferry")
    if len(sys.argv) == 2:
        # Save from a CPU module, then load in a fresh process (no CUDA state inherited).
        os.makedirs(scratch, exist_ok=True)
        tft.save_model(build(0), path)
        return subprocess.call([sys.executable, __file__, scratch, "load"])

    torch.cuda.set_device(1)
    model = build(1).to("cuda")  # another init, on the current device: cuda:1
    ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    missing, unexpected = tft.load_model(model, path)
    assert not missing and not unexpected, (missing, unexpected)
    # Loaded in place: same storage, on cuda:1, tied weights still tied.
    for k, v in model.state_dict().items():
        assert v.device == torch.device("cuda", 1), (k, v.device)
        assert v.data_ptr() == ptrs[k], k
    assert model[3].weight.data_ptr() == model[0].weight.data_ptr()
    ref = build(0)
    for k, v in ref.state_dict().items():
        assert torch.equal(v, model.state_dict()[k].cpu()), k
    tokens = torch.randint(0, 1000, (2, 16))
    with torch.no_grad():
        want = ref(tokens)
        got = model(tokens.to("cuda")).cpu()
    err = (want - got).abs().max().item()
    assert err < 1e-3, err
    torch.cuda.synchronize()
    seen = nvml_processes(os.getpid())
    print("NVML (bus id: this process present):", seen)
    buses = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        buses.append("%04x:%02x:%02x.0" % (p.pci_domain_id, p.pci_bus_id, p.pci_device_id))
    on = {i: seen.get(b[-12:]) for i, b in enumerate(buses)}
    print("by device index:", on)
    assert on[1] is True, on
    assert on[0] is False, "this process holds memory or a context on GPU 0: %s" % on
    print("load_model on cuda:1: %d tensors in place, max |out - ref| %.2e, nothing on GPU 0"
          % (len(ptrs), err))
    return 0


if __name__ == "__main__":
    sys.exit(main())
