"""tensorferry.distributed across processes, one GPU each, the way training jobs run:

    torchrun --nproc_per_node=2 tests/python/distributed_check.py [--dir DIR] [--gib 1]

Rank 0 writes a checkpoint (one file, and the same tensors as two shards with an index); every
rank loads it with tensorferry.distributed.load_file onto its current device (= its local
rank), checks every tensor bit for bit, loads its tensor-parallel slice with `local`, and
checks that the tensors live on its device and that NVML (pynvml, else nvidia-smi) shows the
process on its own GPU only. With --gib > 0 it also times a hot load of a checkpoint of that
size, distributed against every rank reading everything.

Prints "distributed check: PASS" on rank 0 and exits 0; exits 1 on a failure and 77 when the
machine lacks torch.distributed, NCCL or enough GPUs.
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

SKIP = 77


def expected(torch, name, shape, dtype):
    """Deterministic contents from the name, generated on the CPU (same on every rank)."""
    g = torch.Generator().manual_seed(sum(ord(c) * 131 ** i for i, c in enumerate(name)) % 2**62)
    if dtype in (torch.int64, torch.uint8):
        return torch.randint(0, 100, shape, generator=g, dtype=dtype)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)


def specs(torch):
    s = {
        "embed.weight": ((4000, 512), torch.bfloat16),
        "layers.0.attn.qkv.weight": ((1536, 512), torch.bfloat16),
        "layers.0.mlp.fc1.weight": ((2048, 512), torch.float16),
        "layers.0.mlp.fc2.weight": ((512, 2048), torch.float32),
        "step": ((), torch.int64),
        "empty": ((0, 4), torch.float32),
    }
    for i in range(200):
        s["norm.%d" % i] = ((64 + i,), torch.float32)
    return s


def nvml_processes(torch, pid):
    """{bus id: pid present} for every GPU, or None when no NVML access exists."""
    try:
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
    except Exception:
        pass
    try:
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.split()
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30).stdout.strip().splitlines()
        out = {g.lower()[-12:]: False for g in gpus}
        for line in apps:
            p, bus = [x.strip() for x in line.split(",")]
            if int(p) == pid:
                out[bus.lower()[-12:]] = True
        return out
    except Exception:
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None, help="shared scratch directory (default: /dev/shm)")
    ap.add_argument("--gib", type=float, default=1.0, help="size of the timed checkpoint; 0: none")
    args = ap.parse_args()
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        print("distributed check: torch not available; skipped")
        return SKIP
    if not dist.is_available() or "RANK" not in os.environ:
        print("distributed check: run under torchrun --nproc_per_node=2; skipped")
        return SKIP
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ["WORLD_SIZE"])
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        print("distributed check: needs %d GPUs; skipped" % world)
        return SKIP
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off on these machines
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank = dist.get_rank()
    import tensorferry as tf
    import tensorferry.distributed as tfd

    failures = []

    def check(ok, what):
        if not ok:
            failures.append(what)
            print("[rank %d] FAIL %s" % (rank, what), flush=True)

    base = args.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    work = os.path.join(base, "tensorferry_distributed_check")
    s = specs(torch)
    if rank == 0:
        os.makedirs(work, exist_ok=True)
        tensors = {n: expected(torch, n, shape, dt) for n, (shape, dt) in s.items()}
        tf.save_file(tensors, os.path.join(work, "one.ferry"), durable=False)
        names = sorted(tensors)
        half = {n: tensors[n] for n in names[: len(names) // 2]}
        rest = {n: tensors[n] for n in names[len(names) // 2:]}
        tf.save_file(half, os.path.join(work, "model-00001-of-00002.ferry"), durable=False)
        tf.save_file(rest, os.path.join(work, "model-00002-of-00002.ferry"), durable=False)
        wm = {n: "model-00001-of-00002.ferry" for n in half}
        wm.update({n: "model-00002-of-00002.ferry" for n in rest})
        with open(os.path.join(work, "model.ferry.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": wm}, f)
    dist.barrier()

    dev = torch.device("cuda", local_rank)
    for path in ("one.ferry", "model.ferry.index.json"):
        for rounds in (1, 4):
            got = tfd.load_file(os.path.join(work, path), rounds=rounds)
            check(sorted(got) == sorted(s), "%s: tensor names" % path)
            bad = [n for n, (shape, dt) in s.items()
                   if n in got and (got[n].device != dev or got[n].dtype != dt or
                                    tuple(got[n].shape) != tuple(shape) or
                                    not torch.equal(got[n].cpu(), expected(torch, n, shape, dt)))]
            check(not bad, "%s, rounds %d: %d tensors differ, e.g. %s" % (path, rounds, len(bad),
                                                                         bad[:3]))
            if not bad:
                print("[rank %d] %s, rounds %d: %d tensors bit-exact on %s" %
                      (rank, path, rounds, len(got), dev), flush=True)

    # Tensor parallelism: this rank's rows of two matrices, read locally; the rest replicated.
    rows = 4000 // world
    sl = (rank * rows, (rank + 1) * rows)
    got = tfd.load_file(os.path.join(work, "one.ferry"), names=["step", "norm.3"],
                        local={"embed.weight": sl, "layers.0.mlp.fc2.weight": None})
    want = expected(torch, "embed.weight", (4000, 512), torch.bfloat16)[sl[0]:sl[1]]
    check(torch.equal(got["embed.weight"].cpu(), want), "local slice of embed.weight")
    check(torch.equal(got["step"].cpu(), expected(torch, "step", (), torch.int64)), "step")
    check(torch.equal(got["layers.0.mlp.fc2.weight"].cpu(),
                      expected(torch, "layers.0.mlp.fc2.weight", (512, 2048), torch.float32)),
          "local whole tensor")
    if not failures:
        print("[rank %d] local slice rows [%d, %d) and replicated tensors: bit-exact" %
              (rank, sl[0], sl[1]), flush=True)

    # Disagreeing ranks fail everywhere instead of hanging.
    try:
        tfd.load_file(os.path.join(work, "one.ferry"), names=["step" if rank == 0 else "norm.1"])
        check(False, "disagreeing ranks were not detected")
    except tf.InvalidArgumentError as e:
        print("[rank %d] disagreeing requests rejected: %s" % (rank, e), flush=True)

    if args.gib > 0:
        path = os.path.join(work, "timed.ferry")
        n_layers = max(1, int(args.gib * 2**30 / (2 * 4 * 2048 * 2048)))
        if rank == 0:
            g = torch.Generator().manual_seed(0)
            big = {"w.%d" % i: torch.randn((4 * 2048, 2048), generator=g).to(torch.bfloat16)
                   for i in range(n_layers)}
            tf.save_file(big, path, durable=False)
            nbytes = sum(t.numel() * 2 for t in big.values())
            del big
        dist.barrier()
        nbytes = n_layers * 4 * 2048 * 2048 * 2
        for label, fn in (("every rank reads all", lambda: tf.load_file(path, device="cuda")),
                          ("distributed", lambda: tfd.load_file(path))):
            times = []
            for _ in range(3):
                dist.barrier()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = fn()
                torch.cuda.current_stream().synchronize()
                times.append(time.perf_counter() - t0)
                del out
            t = torch.tensor([min(times)], device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if rank == 0:
                print("timed, %.2f GiB hot, %-22s %.3f s  %.1f GB/s per rank" %
                      (nbytes / 2**30, label + ":", t.item(), nbytes / t.item() / 1e9), flush=True)

    procs = nvml_processes(torch, os.getpid())
    if procs is None:
        print("[rank %d] NVML check skipped (no pynvml or nvidia-smi)" % rank, flush=True)
    else:
        p = torch.cuda.get_device_properties(local_rank)
        own = ("%02x:%02x.0" % (p.pci_bus_id, p.pci_device_id))
        mine = {bus: present for bus, present in procs.items()}
        check(any(present for bus, present in mine.items() if bus.endswith(own)),
              "NVML does not list this process on its GPU %s" % own)
        check(not any(present for bus, present in mine.items() if not bus.endswith(own)),
              "NVML lists this process on another GPU: %s" % mine)
        print("[rank %d] NVML: %s (own GPU %s)" % (rank, mine, own), flush=True)

    flag = torch.tensor([len(failures)], device=dev)
    dist.all_reduce(flag)
    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
        print("distributed check: %s" % ("PASS" if flag.item() == 0 else "FAIL"), flush=True)
    dist.destroy_process_group()
    return 0 if flag.item() == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
