"""One rank of a sharded save over torch.distributed, then a load of what every rank saved.

    save_sharded_check.py RANK WORLD DIR gloo|nccl

gloo: CPU tensors; nccl: CUDA tensors of device RANK (read in place), and the checkpoint is
loaded back with tensorferry.distributed.load_file onto every rank. Exit 0 when every tensor
of every rank round-trips bit-exact, twice (a synchronous save, then an asynchronous one that
replaces it), and only the newest checkpoint's files remain."""

import os
import sys

import numpy as np
import torch
import torch.distributed as dist

import tensorferry as tf
import tensorferry.distributed as tfd


def tensors(rank, generation, device):
    g = torch.Generator().manual_seed(generation * 100 + rank)
    out = {
        "r%d.w" % rank: torch.randn(1000 + rank, 257, generator=g).to(torch.bfloat16),
        "r%d.b" % rank: torch.arange(33 + rank, dtype=torch.float32) * generation,
        "r%d.i" % rank: torch.randint(0, 1 << 30, (4099,), generator=g, dtype=torch.int64),
    }
    return {k: v.to(device) for k, v in out.items()}


def main():
    rank, world, directory, backend = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    index = os.path.join(directory, "model.ferry.index.json")
    failures = 0
    for generation, use_async in ((1, False), (2, True)):
        mine = tensors(rank, generation, device)
        if use_async:
            fut = tfd.save_file(mine, index, metadata={"generation": str(generation)},
                                encoding="shuffle_zstd", async_save=True)
            for v in mine.values():
                v.zero_()  # snapshotted: ours to change
            assert fut.result() == index
        else:
            assert tfd.save_file(mine, index, metadata={"generation": str(generation)}) == index
        dist.barrier()
        with tfd.open_checkpoint(index) as ck:
            names = ck.keys()
            assert len(names) == 3 * world, names
            for r in range(world):
                for k, v in tensors(r, generation, "cpu").items():
                    arr = tf.load_file(ck.reader(k).path)[k]
                    want = v.view(torch.int16).numpy() if v.dtype == torch.bfloat16 else v.numpy()
                    have = np.asarray(arr).view(want.dtype)
                    if not np.array_equal(have, want):
                        print("rank %d: generation %d: %s differs" % (rank, generation, k))
                        failures += 1
        if backend == "nccl":
            loaded = tfd.load_file(index)
            for r in range(world):
                for k, v in tensors(r, generation, device).items():
                    if not torch.equal(loaded[k], v):
                        print("rank %d: distributed load of %s differs" % (rank, k))
                        failures += 1
        dist.barrier()
        files = sorted(os.listdir(directory))
        shards = [f for f in files if f.endswith(".ferry")]
        if len(shards) != world or "model.ferry.index.json" not in files:
            print("rank %d: generation %d leaves %s" % (rank, generation, files))
            failures += 1
    dist.barrier()
    dist.destroy_process_group()
    print("rank %d: sharded save %s" % (rank, "FAIL" if failures else "ok"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
