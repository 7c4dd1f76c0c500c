"""Distributed loading with torch.distributed: every rank of a process group gets the whole
checkpoint, while each byte is read from storage (and crosses a host-to-device link) on one
rank only; the other ranks receive it through the group's collectives (NCCL over NVLink).

    import torch.distributed as dist
    import tensorferry.distributed as tfd
    dist.init_process_group("nccl")
    torch.cuda.set_device(local_rank)
    state = tfd.load_file("model.ferry")                  # or "model.ferry.index.json"
    shard = tfd.load_file("model.ferry", local={"lm_head.weight": (r0, r1)})

How: the tensors, in file order, form one byte sequence cut into world_size * rounds parts at
row boundaries of dimension 0. Rank r reads its parts with the normal TensorFerry loader onto
its current device and stream, then ``torch.distributed.broadcast`` (asynchronous, so the
broadcasts of one round overlap the reads of the next) sends each part to every rank. Tensors
of 1 MiB or more get their own allocation; smaller ones are views into one shared buffer, so
thousands of small tensors cost a few broadcasts, not thousands.

This module uses torch.distributed's own collectives instead of handing the group's NCCL
communicator to the C++ DistributedLoader: ProcessGroupNCCL exposes its communicator only
through a private, unstable method (``_comm_ptr()``), and the collectives cost nothing extra
here (the work is the same broadcasts). C++ callers with an ``ncclComm_t`` use
``ferry::DistributedLoader`` (include/ferry/distributed.hpp).

Collective: every rank of the group must call load_file with the same checkpoint and the same
`names` (the default: all tensors). `local` (a rank's tensor-parallel slices) may differ per
rank and costs no communication. Nothing is created on any other GPU than the current device
(or the one `device` names).
"""

import ctypes
import hashlib
import json
import os
import re
import secrets

import tensorferry as _tf

__all__ = ["load_file", "save_file", "write_shard_index", "open_checkpoint", "split_plan"]

_SMALL = 1 << 20  # tensors below this share one allocation (and one broadcast per run)
_ALIGN = 256


def split_plan(items, nranks, rounds):
    """ferry::SplitPlan (distributed.hpp), through the C API: items are (bytes, row_bytes) with
    row_bytes 0 for items that cannot be cut; returns (item, segment, begin, len) pieces, rank =
    segment // rounds. The same input gives the same plan on every rank."""
    citems = (_tf._lib.PlanItem * max(1, len(items)))(*[(int(b), int(r)) for b, r in items])
    count = ctypes.c_size_t()
    _tf._lib.call("ferry_split_plan", citems, len(items), nranks, rounds, None, 0,
                  ctypes.byref(count))
    pieces = (_tf._lib.PlanPiece * max(1, count.value))()
    _tf._lib.call("ferry_split_plan", citems, len(items), nranks, rounds, pieces, count.value,
                  ctypes.byref(count))
    return [(p.item, p.segment, p.begin, p.len) for p in pieces[:count.value]]


class _Checkpoint:
    """Shards (tensorferry.Reader) and name -> shard, for one file or a sharded index (opened,
    parsed and checked by the library)."""

    def __init__(self, path):
        path = os.fspath(path)
        self.path = path
        self.readers = []
        self.where = {}
        if not path.endswith(".json"):
            self.readers.append(_tf.Reader(path))
            self.where = {n: 0 for n in self.readers[0].keys()}
            return
        handle = ctypes.c_void_p()
        _tf._lib.call("ferry_sharded_open", _tf._path(path), None, ctypes.byref(handle))
        L = _tf._lib.lib()
        try:
            for s in range(L.ferry_sharded_num_shards(handle)):
                shard = ctypes.c_void_p()
                _tf._lib.call("ferry_sharded_shard", handle, s, ctypes.byref(shard))
                self.readers.append(_tf.Reader(None, _handle=shard))
                for name in self.readers[-1].keys():
                    self.where[name] = s
        except BaseException:
            self.close()
            raise
        finally:
            L.ferry_sharded_free(handle)

    def keys(self):
        return sorted(self.where)

    def reader(self, name):
        try:
            return self.readers[self.where[name]]
        except KeyError:
            raise _tf.NotFoundError(_tf._lib.NOT_FOUND,
                                    "%s: no tensor named %r" % (self.path, name)) from None

    def close(self):
        for r in self.readers:
            r.close()
        self.readers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_checkpoint(path):
    """A context manager over a .ferry file or a sharded index (*.index.json): keys(),
    reader(name) (a tensorferry.Reader), close()."""
    return _Checkpoint(path)


def _row_bytes(reader, info):
    if len(info.shape) == 0 or info.shape[0] < 2:
        return 0
    if info.dtype == "F4_E2M1FN" and _tf._numel(info.shape[1:]) % 2:
        return 0  # rows of an odd count of packed FP4 values do not start on a byte
    return reader.region(info.name, (0, 1))[1]


def _agree(torch, dist, group, device, words, op):
    t = torch.tensor(words, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def load_file(path, process_group=None, device="cuda", *, names=None, local=None, rounds=4,
              check_plan=True):
    """Loads a checkpoint onto every rank of `process_group` (default: the default group).

    path: a .ferry (or .safetensors) file, or a sharded index (*.index.json).
    device: "cuda" (the current device), "cuda:N" or a torch.device; tensors are copied on that
    device's current torch stream, and the call returns once they are complete.
    names: the tensors every rank receives (default: all); the same on every rank.
    local: {name: (row_begin, row_end) or None} read by this rank alone (its tensor-parallel
    slice, or a whole tensor); no communication. Returned under the same names.
    Returns {name: torch.Tensor}.
    """
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("tensorferry.distributed: torch.distributed is not initialized")
    group = process_group
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    index = _tf._cuda_index(torch, device)
    dev = torch.device("cuda", index)
    local = dict(local or {})
    with _Checkpoint(path) as ck, torch.cuda.device(index):
        stream = torch.cuda.current_stream(index)
        wanted = ck.keys() if names is None else list(names)
        items = []  # (shard, data_offset, name, info, row_bytes)
        failure = None
        try:
            for name in wanted:
                r = ck.reader(name)
                info = r.info(name)
                items.append((ck.where[name], info.data_offset, name, info, _row_bytes(r, info)))
            for name in local:
                ck.reader(name)
        except Exception as e:  # reported to the other ranks by the plan check
            failure = e
        items.sort(key=lambda m: (m[0], m[1], m[2]))
        if check_plan:
            h = hashlib.blake2b(repr((world, rounds, [(m[0], m[1], m[2], m[3].nbytes, m[4])
                                                      for m in items])).encode(),
                                digest_size=8).digest()
            hv = int.from_bytes(h, "little") >> 2  # fits int64 with room
            top = (1 << 62) - 1
            words = [top, top] if failure is not None else [hv, top - hv]
            got = _agree(torch, dist, group, dev, words, dist.ReduceOp.MAX)
            if failure is not None:
                raise failure
            if got != words:
                raise _tf.InvalidArgumentError(
                    _tf._lib.INVALID_ARGUMENT,
                    "%s: rank %d: the ranks disagree on the tensors to load (or another rank "
                    "failed to plan); every rank must pass the same names" % (ck.path, rank))
        elif failure is not None:
            raise failure

        # Destinations: big tensors alone, small ones packed (file order) in one buffer.
        out = {}
        arena_bytes = 0
        offsets = []
        for shard, _, name, info, _ in items:
            if info.nbytes >= _SMALL or info.nbytes == 0:
                offsets.append(None)
            else:
                offsets.append(arena_bytes)
                arena_bytes += (info.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        with torch.cuda.stream(stream):
            arena = torch.empty(arena_bytes, dtype=torch.uint8, device=dev) if arena_bytes else None
            flats = []  # per item: a flat uint8 view of its bytes
            for (shard, _, name, info, _), off in zip(items, offsets):
                if off is None:
                    t = _tf._torch_empty(torch, info.dtype, info.shape, info.nbytes, dev)
                    flat = t.reshape(-1).view(torch.uint8) if info.nbytes else None
                else:
                    flat = arena[off:off + info.nbytes]
                    t = _packed_view(torch, flat, info)
                out[name] = t
                flats.append(flat)

            pieces = split_plan([(m[3].nbytes, m[4]) for m in items], world, rounds)
            # Per segment: broadcasts (flat tensor) with runs of packed small tensors joined.
            seg_ops = [[] for _ in range(world * rounds)]
            mine = [[] for _ in range(rounds)]
            for item, seg, begin, length in pieces:
                flat = flats[item]
                ops = seg_ops[seg]
                off = offsets[item]
                if off is not None and ops and ops[-1][0] == "arena" and \
                        0 <= off + begin - ops[-1][2] < _ALIGN:
                    ops[-1] = ("arena", ops[-1][1], off + begin + length)
                elif off is not None:
                    ops.append(("arena", off + begin, off + begin + length))
                else:
                    ops.append(("own", item, (begin, begin + length)))
                if seg // rounds == rank:
                    mine[seg % rounds].append((item, begin, length))

            loader = _tf._default_loader(index)
            works = []
            for k in range(rounds):
                if failure is None:
                    try:
                        _read(loader, ck, items, flats, mine[k], stream)
                    except Exception as e:  # keep the broadcasts going so no rank hangs
                        failure = e
                for r in range(world):
                    src = dist.get_global_rank(group, r) if group is not None else r
                    for op in seg_ops[r * rounds + k]:
                        if op[0] == "arena":
                            buf = arena[op[1]:op[2]]
                        else:
                            b, e = op[2]
                            buf = flats[op[1]][b:e]
                        works.append(dist.broadcast(buf, src=src, group=group, async_op=True))
            for name, rows in local.items():
                if failure is not None:
                    break
                try:
                    out[name] = _tf._torch_cuda_load(ck.reader(name), [(name, rows)], dev,
                                                     stream=stream, non_blocking=True,
                                                     loader=loader)[0]
                except Exception as e:
                    failure = e
            for w in works:
                w.wait()  # the current stream waits for the broadcasts
        flag = _agree(torch, dist, group, dev, [1 if failure is not None else 0],
                      dist.ReduceOp.MAX)
        if failure is not None:
            raise failure
        if flag[0]:
            raise RuntimeError("tensorferry.distributed: another rank failed to load %s (its "
                               "error says why)" % ck.path)
        stream.synchronize()
    return out


def _packed_view(torch, flat, info):
    """Bytes in the shared buffer as the dtype and shape tensorferry.load_file would give the
    tensor (uint8 where torch has no such dtype); the offset is 256-byte aligned."""
    like = _tf._torch_empty(torch, info.dtype, info.shape, info.nbytes, "meta")
    return flat.view(like.dtype).view(like.shape)


def _read(loader, ck, items, flats, pieces, stream):
    """Enqueues this rank's pieces of one round on `stream` (returns before they complete)."""
    by_reader = {}
    for item, begin, length in pieces:
        shard, _, name, info, row_bytes = items[item]
        flat = flats[item]
        if begin == 0 and length == info.nbytes:
            rows = None
        else:
            rows = (begin // row_bytes, (begin + length) // row_bytes)
        ptr = flat.data_ptr() + begin
        by_reader.setdefault(shard, []).append((name, rows, ptr, length))
    for shard, targets in by_reader.items():
        loader.load_into(ck.readers[shard], targets, stream=stream.cuda_stream, non_blocking=True)


# ---- saving ---------------------------------------------------------------------------------


def write_shard_index(index_path, shard_files, metadata=None):
    """Writes the index of a sharded checkpoint (ferry::WriteShardIndex) for shard files that
    exist, relative to the index's directory; atomic (temporary file, fsync, rename)."""
    files = [_tf._path(f) for f in shard_files]
    md = dict(metadata or {})
    keys = [_tf._lib.encode(k) for k in md]
    values = [_tf._lib.encode(v) for v in md.values()]
    arr = (ctypes.c_char_p * max(1, len(files)))(*files)
    karr = (ctypes.c_char_p * max(1, len(keys)))(*keys)
    varr = (ctypes.c_char_p * max(1, len(values)))(*values)
    _tf._lib.call("ferry_write_shard_index", _tf._path(index_path), arr, len(files), karr, varr,
                  len(keys))


def _index_stem(index_path):
    base = os.path.basename(index_path)
    for suffix in (".ferry.index.json", ".index.json", ".json"):
        if base.endswith(suffix) and len(base) > len(suffix):
            return base[:-len(suffix)]
    return base


def _indexed_files(index_path):
    """The shard file names the index at `index_path` lists; empty when there is none or it
    does not parse. Only names of this save's own form are ever deleted (save_file), which
    keeps them plain names inside the index's folder."""
    try:
        with open(index_path, "rb") as f:
            index = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError):  # absent, unreadable, not UTF-8, not JSON
        return set()
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict):
        return set()
    return {v for v in wm.values() if isinstance(v, str)}


def _agree_device(torch, dist, group):
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class ShardedSaveFuture:
    """An asynchronous sharded save: every rank's shard is being written in the background.
    wait() / result() are collective (every rank of the group must call one of them): they wait
    for this rank's shard, agree that every shard is durable, and rank 0 commits the index;
    until then the index still names the previous checkpoint. done() tells whether this rank's
    shard is written (no communication). result() returns the index path or raises."""

    def __init__(self, finish, future, failure):
        self._finish = finish
        self._future = future
        self._failure = failure
        self._outcome = None

    def done(self):
        return self._outcome is not None or self._future is None or self._future.done()

    def wait(self):
        if self._outcome is None:
            try:
                self._outcome = (self._finish(self._future, self._failure), None)
            except Exception as e:
                self._outcome = (None, e)
        return True

    def result(self):
        self.wait()
        if self._outcome[1] is not None:
            raise self._outcome[1]
        return self._outcome[0]


def save_file(tensors, path, process_group=None, *, metadata=None, encoding="raw",
              zstd_level=None, durable=True, scaling_state=None, async_save=False, staging=None,
              remove_replaced=True):
    """Saves a sharded checkpoint from every rank of `process_group` at once (collective):
    each rank writes `tensors` (its own; names unique across ranks; CUDA tensors of the current
    device are read in place on torch's current stream) to its own shard file, in parallel,
    and rank 0 commits the index `path` (ferry's *.index.json format) only after every shard
    is durable. Shard files are "<stem>-<save id>-<rank + 1>-of-<world>.ferry" beside the
    index, with a save id no earlier save used, so the previous checkpoint's files are never
    touched before the new index replaces it: a crash at any point leaves the previous
    checkpoint complete and loadable, or the new one. After the commit, rank 0 deletes the
    files of the replaced index that follow this naming (remove_replaced=True).

    metadata (str -> str) goes into every shard and into the index. With async_save=True the
    call returns a ShardedSaveFuture once this rank's tensors are snapshotted into host memory
    (staging: see tensorferry.save_file_async); its wait()/result() is collective and commits
    the index. Otherwise returns the index path once the checkpoint is committed; raises on
    every rank when any rank failed.
    """
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("tensorferry.distributed: torch.distributed is not initialized")
    group = process_group
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    dev = _agree_device(torch, dist, group)
    path = os.fspath(path)
    token = secrets.randbits(62) | 1 if rank == 0 else 0
    token = _agree(torch, dist, group, dev, [token], dist.ReduceOp.MAX)[0]
    stem = _index_stem(path)
    directory = os.path.dirname(path) or "."
    files = ["%s-%016x-%05d-of-%05d.ferry" % (stem, token, r + 1, world) for r in range(world)]
    shard = os.path.join(directory, files[rank])
    metadata = dict(metadata or {})
    failure = future = None
    try:
        kwargs = dict(metadata=metadata, encoding=encoding, zstd_level=zstd_level,
                      durable=durable, scaling_state=scaling_state)
        if async_save:
            future = _tf.save_file_async(tensors, shard, staging=staging, **kwargs)
        else:
            _tf.save_file(tensors, shard, **kwargs)
    except Exception as e:  # reported to the other ranks before anything is committed
        failure = e

    def finish(future, failure):
        if future is not None and failure is None:
            try:
                future.result()
            except Exception as e:
                failure = e
        flag = _agree(torch, dist, group, dev, [1 if failure is not None else 0],
                      dist.ReduceOp.MAX)[0]
        index_failure = None
        replaced = set()
        if rank == 0 and not flag:
            if remove_replaced:
                replaced = _indexed_files(path)
            try:
                write_shard_index(path, files, metadata)
            except Exception as e:
                index_failure = e
            if index_failure is None:
                # The replaced checkpoint's shards go now, before the last agreement, not
                # after it: every rank returns only once they are gone, so a rank that looks
                # at the folder (or starts the next save) right away never finds them,
                # whatever the timing. (Same order as ShardedSave::Conclude in C++.)
                pattern = re.compile(re.escape(stem) +
                                     r"-[0-9a-f]{16}-[0-9]{5}-of-[0-9]{5}\.ferry")
                for f in replaced - set(files):
                    if pattern.fullmatch(f):
                        try:
                            os.unlink(os.path.join(directory, f))
                        except OSError:
                            pass
        flag2 = _agree(torch, dist, group, dev, [1 if index_failure is not None else 0],
                       dist.ReduceOp.MAX)[0]
        if failure is not None or flag or flag2:
            try:
                os.unlink(shard)  # the index names the previous checkpoint: this is garbage
            except OSError:
                pass
            if failure is not None:
                raise failure
            if index_failure is not None:
                raise index_failure
            raise RuntimeError("tensorferry.distributed: rank %d: another rank failed to save %s "
                               "(its error says why)" % (rank, path))
        return path

    if async_save:
        return ShardedSaveFuture(finish, future, failure)
    return finish(None, failure)
