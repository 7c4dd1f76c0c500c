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

The plan (which tensors, in which order, where each lands, who reads what, which broadcasts
carry it, and the ranks' agreement on all of it) is the library's, the same as the C++
DistributedLoader's (ferry_dist_plan_t); this module only moves the bytes with
torch.distributed's own collectives and hands the library an all-reduce for the agreement.
It does not pass the group's NCCL communicator to the C++ DistributedLoader: ProcessGroupNCCL
exposes its communicator only through a private, unstable method (``_comm_ptr()``), and the
collectives cost nothing extra here (the work is the same broadcasts). C++ callers with an
``ncclComm_t`` use ``ferry::DistributedLoader`` (include/ferry/distributed.hpp).

Collective: every rank of the group must call load_file with the same checkpoint and the same
`names` (the default: all tensors). `local` (a rank's tensor-parallel slices) may differ per
rank and costs no communication. Nothing is created on any other GPU than the current device
(or the one `device` names).
"""

import ctypes
import os

import tensorferry as _tf
from tensorferry import _lib

__all__ = ["load_file", "save_file", "write_shard_index", "open_checkpoint", "split_plan"]

_SMALL = 1 << 20  # tensors below this share one allocation (and one broadcast per run)


def split_plan(items, nranks, rounds):
    """ferry::SplitPlan (distributed.hpp), through the C API: items are (bytes, row_bytes) with
    row_bytes 0 for items that cannot be cut; returns (item, segment, begin, len) pieces, rank =
    segment // rounds. The same input gives the same plan on every rank."""
    citems = (_lib.PlanItem * max(1, len(items)))(*[(int(b), int(r)) for b, r in items])
    count = ctypes.c_size_t()
    _lib.call("ferry_split_plan", citems, len(items), nranks, rounds, None, 0,
              ctypes.byref(count))
    pieces = (_lib.PlanPiece * max(1, count.value))()
    _lib.call("ferry_split_plan", citems, len(items), nranks, rounds, pieces, count.value,
              ctypes.byref(count))
    return [(p.item, p.segment, p.begin, p.len) for p in pieces[:count.value]]


# ---- the group's collective -----------------------------------------------------------------


class _Collective:
    """The library's ferry_all_reduce_max_fn over `reduce`, a function from a list of unsigned
    64-bit words to their element-wise maximum over the group. An exception `reduce` raises
    fails the library call that made it, and call() raises it instead of the library's error."""

    def __init__(self, reduce):
        self.error = None

        def all_reduce_max(_user, words, count):
            try:
                out = reduce([words[i] for i in range(count)])
                for i in range(count):
                    words[i] = int(out[i])
                return 0
            except BaseException as e:  # noqa: B902 - any exception fails the library call
                self.error = e
                return 1

        self.c_function = _lib.ALL_REDUCE_MAX_FN(all_reduce_max)

    def call(self, name, *args):
        try:
            _lib.call(name, *args)
        except _tf.FerryError:
            error, self.error = self.error, None
            if error is not None:
                raise error
            raise


def _torch_reduce(torch, dist, group, device):
    """Maximum of unsigned 64-bit words over `group` with torch.distributed's all_reduce, on
    int64 values shifted by 2**63 (which keeps their order)."""

    def reduce(words):
        t = torch.tensor([w - (1 << 63) for w in words], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return [v + (1 << 63) for v in t.tolist()]

    return reduce


def _group_device(torch, dist, group):
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _initialized(dist):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("tensorferry.distributed: torch.distributed is not initialized")


# ---- loading --------------------------------------------------------------------------------


class _Checkpoint(_tf._Closable):
    """Shards (tensorferry.Reader) and name -> shard, for one file or a sharded index (opened,
    parsed and checked by the library), over one ferry_sharded_t."""

    def __init__(self, path):
        path = os.fspath(path)
        self.path = path
        self.readers = []
        self.where = {}
        self._handle = None
        handle = ctypes.c_void_p()
        try:
            # An index URL may carry a query (a presigned one): the name ends before it.
            if (path.split("?", 1)[0] if "://" in path else path).endswith(".json"):
                _lib.call("ferry_sharded_open", _tf._path(path), None, ctypes.byref(handle))
                self._handle = handle
                for s in range(_lib.lib().ferry_sharded_num_shards(handle)):
                    shard = ctypes.c_void_p()
                    _lib.call("ferry_sharded_shard", handle, s, ctypes.byref(shard))
                    self.readers.append(_tf.Reader(None, _handle=shard))
            else:
                self.readers.append(_tf.Reader(path))
                _lib.call("ferry_sharded_from_reader", self.readers[0].handle,
                          ctypes.byref(handle))
                self._handle = handle
            for s, reader in enumerate(self.readers):
                self.where.update(dict.fromkeys(reader.keys(), s))
        except BaseException:
            self.close()
            raise

    def keys(self):
        return sorted(self.where)

    def reader(self, name):
        try:
            return self.readers[self.where[name]]
        except KeyError:
            raise _tf.NotFoundError(_lib.NOT_FOUND,
                                    "%s: no tensor named %r" % (self.path, name)) from None

    def close(self):
        for r in self.readers:
            r.close()
        self.readers = []
        h, self._handle = self._handle, None
        if h is not None:
            _lib.lib().ferry_sharded_free(h)



def open_checkpoint(path):
    """A context manager over a .ferry file or a sharded index (*.index.json): keys(),
    reader(name) (a tensorferry.Reader), close()."""
    return _Checkpoint(path)


class _Item:
    __slots__ = ("name", "shard", "nbytes", "arena_offset")


class _Plan(_tf._Closable):
    """The library's plan of a distributed load (ferry_dist_plan_t) for this rank: items (in
    file order; arena_offset None for a buffer of its own), arena_bytes, broadcasts[round] as
    (root, item, begin, bytes) and reads[round] as (item, begin, bytes, (row_begin, row_end)).
    Creating it is collective: the ranks agree on it (check_plan), or all fail."""

    def __init__(self, ck, names, local, rank, world, rounds, check_plan, collective):
        opts = _lib.DistPlanOptions()
        _lib.lib().ferry_dist_plan_options_init(ctypes.byref(opts))
        opts.rank, opts.nranks, opts.rounds = rank, world, rounds
        opts.check_plan = 1 if check_plan else 0
        opts.own_min_bytes = _SMALL
        opts.all_reduce_max = collective.c_function
        local = [_tf._name(n) for n in local]
        opts.local_names = (ctypes.c_char_p * max(1, len(local)))(*local)
        opts.num_local = len(local)
        names = [] if names is None else [_tf._name(n) for n in names]
        reqs = (_lib.LoadRequest * max(1, len(names)))()
        for i, name in enumerate(names):
            _lib.lib().ferry_load_request_init(ctypes.byref(reqs[i]), name)
        self._collective = collective  # the library calls it until the plan is freed
        self._handle = None
        handle = ctypes.c_void_p()
        collective.call("ferry_dist_plan_create", ck._handle, reqs, len(names),
                        ctypes.byref(opts), ctypes.byref(handle))
        self._handle = handle
        view = _lib.DistPlanView()
        view.struct_size = ctypes.sizeof(view)
        _lib.call("ferry_dist_plan_view", handle, ctypes.byref(view))
        self.items = []
        for c in view.items[:view.num_items]:
            item = _Item()
            item.name = _lib.decode(c.name, ck.path, "tensor name")
            item.shard, item.nbytes = c.shard, c.bytes
            item.arena_offset = None if c.arena_offset == _lib.DIST_OWN_BUFFER else c.arena_offset
            self.items.append(item)
        self.arena_bytes = view.arena_bytes
        self.rounds = view.rounds
        self.broadcasts = [[] for _ in range(self.rounds)]
        for b in view.broadcasts[:view.num_broadcasts]:
            self.broadcasts[b.round].append((b.root, b.item, b.begin, b.bytes))
        self.reads = [[] for _ in range(self.rounds)]
        for r in view.reads[:view.num_reads]:
            self.reads[r.round].append((r.item, r.begin, r.bytes, (r.row_begin, r.row_end)))

    def conclude(self, failed):
        """Collective: raises (InternalError) when this or another rank failed."""
        self._collective.call("ferry_dist_plan_conclude", self._handle, 1 if failed else 0)

    def close(self):
        h, self._handle = self._handle, None
        if h is not None:
            _lib.lib().ferry_dist_plan_free(h)



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

    _initialized(dist)
    group = process_group
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    index = _tf._cuda_index(torch, device)
    dev = torch.device("cuda", index)
    local = dict(local or {})
    collective = _Collective(_torch_reduce(torch, dist, group, dev))
    with _Checkpoint(path) as ck, torch.cuda.device(index):
        stream = torch.cuda.current_stream(index)
        with _Plan(ck, names, local, rank, world, rounds, check_plan, collective) as plan, \
                torch.cuda.stream(stream):
            out, buffers = _destinations(torch, ck, plan, dev)
            loader = _tf._default_loader(index)
            failure = None
            works = []
            for k in range(plan.rounds):
                if failure is None:
                    try:
                        _read(loader, ck, plan, buffers, k, stream)
                    except Exception as e:  # keep the broadcasts going so no rank hangs
                        failure = e
                for root, item, begin, nbytes in plan.broadcasts[k]:
                    src = dist.get_global_rank(group, root) if group is not None else root
                    buf = buffers[item][begin:begin + nbytes]
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
            try:
                plan.conclude(failure is not None)
            except _tf.FerryError:
                if failure is not None:
                    raise failure from None
                raise
        stream.synchronize()
    return out


def _destinations(torch, ck, plan, dev):
    """({name: tensor}, per item a flat uint8 tensor its broadcasts address: the item's own
    bytes, or the whole arena shifted to the item's offset)."""
    arena = torch.empty(plan.arena_bytes, dtype=torch.uint8, device=dev) \
        if plan.arena_bytes else None
    out = {}
    buffers = []
    for item in plan.items:
        info = ck.reader(item.name).info(item.name)
        if item.arena_offset is None:
            t = _tf._torch_empty(torch, info.dtype, info.shape, info.nbytes, dev)
            buffers.append(t.reshape(-1).view(torch.uint8) if info.nbytes else None)
        else:
            # An arena broadcast may run on through the items after this one.
            buffers.append(arena[item.arena_offset:])
            t = _packed_view(torch, buffers[-1][:info.nbytes], info)
        out[item.name] = t
    return out, buffers


def _packed_view(torch, flat, info):
    """Bytes in the shared buffer as the dtype and shape tensorferry.load_file would give the
    tensor (uint8 where torch has no such dtype); the offset is 256-byte aligned."""
    like = _tf._torch_empty(torch, info.dtype, info.shape, info.nbytes, "meta")
    return flat.view(like.dtype).view(like.shape)


def _read(loader, ck, plan, buffers, k, stream):
    """Enqueues this rank's reads of round k on `stream` (returns before they complete)."""
    by_shard = {}
    for item, begin, nbytes, rows in plan.reads[k]:
        it = plan.items[item]
        ptr = buffers[item].data_ptr() + begin
        by_shard.setdefault(it.shard, []).append((it.name, rows, ptr, nbytes))
    for shard, targets in by_shard.items():
        loader.load_into(ck.readers[shard], targets, stream=stream.cuda_stream, non_blocking=True)


# ---- saving ---------------------------------------------------------------------------------


def write_shard_index(index_path, shard_files, metadata=None):
    """Writes the index of a sharded checkpoint (ferry::WriteShardIndex) for shard files that
    exist, relative to the index's directory; atomic (temporary file, fsync, rename)."""
    files = [_tf._path(f) for f in shard_files]
    arr = (ctypes.c_char_p * max(1, len(files)))(*files)
    _lib.call("ferry_write_shard_index", _tf._path(index_path), arr, len(files),
              *_metadata_arrays(metadata))


def _metadata_arrays(metadata):
    """(keys, values, count) of str -> str metadata as C string arrays."""
    md = dict(metadata or {})
    keys = [_lib.encode(k) for k in md]
    values = [_lib.encode(v) for v in md.values()]
    return ((ctypes.c_char_p * max(1, len(keys)))(*keys),
            (ctypes.c_char_p * max(1, len(values)))(*values), len(keys))


class ShardedSaveFuture:
    """An asynchronous sharded save: every rank's shard is being written in the background.
    wait() / result() are collective (every rank of the group must call one of them): they wait
    for this rank's shard, agree that every shard is durable, and rank 0 commits the index;
    until then the index still names the previous checkpoint. done() tells whether this rank's
    shard is written (no communication). result() returns the index path or raises."""

    def __init__(self, save, path):
        self._save = save
        self._path = path
        self._outcome = None

    def done(self):
        return self._outcome is not None or self._save.shard_done()

    def wait(self):
        if self._outcome is None:
            try:
                self._save.finish()
                self._outcome = (self._path, None)
            except Exception as e:
                self._outcome = (None, e)
            finally:
                self._save.close()
        return True

    def result(self):
        self.wait()
        if self._outcome[1] is not None:
            raise self._outcome[1]
        return self._outcome[0]


class _ShardedSave(_tf._Closable):
    """ferry_sharded_save_t: this rank's part of a sharded save (begun collectively)."""

    def __init__(self, path, rank, world, collective, writer_options, metadata, remove_replaced):
        opts = _lib.ShardedSaveOptions()
        _lib.lib().ferry_sharded_save_options_init(ctypes.byref(opts))
        opts.rank, opts.nranks = rank, world
        opts.all_reduce_max = collective.c_function
        opts.writer = ctypes.pointer(writer_options)
        opts.metadata_keys, opts.metadata_values, opts.num_metadata = _metadata_arrays(metadata)
        opts.remove_replaced = 1 if remove_replaced else 0
        self._collective = collective  # the library calls it until the save is freed
        self._handle = None
        handle = ctypes.c_void_p()
        collective.call("ferry_sharded_save_begin", _tf._path(path), ctypes.byref(opts),
                        ctypes.byref(handle))
        self._handle = handle
        self.writer = _lib.lib().ferry_sharded_save_writer(handle)

    def give_up(self):
        """Collective: this rank failed before its commit; the save fails on every rank."""
        _lib.lib().ferry_writer_abort(self.writer)
        try:
            self.commit()
        except _tf.FerryError:
            pass

    def commit(self):
        self._collective.call("ferry_sharded_save_commit", self._handle)

    def commit_async(self):
        self._collective.call("ferry_sharded_save_commit_async", self._handle)

    def shard_done(self):
        return bool(_lib.lib().ferry_sharded_save_shard_done(self._handle))

    def finish(self):
        self._collective.call("ferry_sharded_save_finish", self._handle)

    def close(self):
        h, self._handle = self._handle, None
        if h is not None:
            _lib.lib().ferry_sharded_save_free(h)


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

    _initialized(dist)
    group = process_group
    collective = _Collective(_torch_reduce(torch, dist, group, _group_device(torch, dist, group)))
    return _save_sharded(tensors, os.fspath(path), dist.get_rank(group),
                         dist.get_world_size(group), collective, metadata=metadata,
                         encoding=encoding, zstd_level=zstd_level, durable=durable,
                         scaling_state=scaling_state, async_save=async_save, staging=staging,
                         remove_replaced=remove_replaced)


def _save_sharded(tensors, path, rank, world, collective, *, metadata, encoding, zstd_level,
                  durable, scaling_state, async_save, staging, remove_replaced):
    """save_file over any collective (see _Collective): the library names the shards, agrees,
    commits the index and removes the replaced shards; this adds this rank's tensors."""
    if encoding not in _lib.ENCODINGS:
        raise ValueError("tensorferry: encoding must be one of %s" % sorted(_lib.ENCODINGS))
    opts = _lib.writer_options(encoding, zstd_level, durable=durable)
    pool = _tf._staging_for(tensors, staging) if async_save else None
    opts.staging = pool._handle if pool is not None else None
    save = _ShardedSave(path, rank, world, collective, opts, metadata, remove_replaced)
    try:
        keep = []  # CUDA sources until the snapshot is complete
        try:
            _tf._refuse_shared(tensors)
            _tf._fill_writer(save.writer, tensors, metadata, scaling_state, keep)
        except BaseException:
            save.give_up()  # reported to the other ranks before anything is committed
            raise
        if async_save:
            try:
                save.commit_async()
            except _tf.FerryError:
                pass  # finish reports it, on every rank
            future, save = ShardedSaveFuture(save, path), None
            return future
        save.commit()
        return path
    finally:
        if save is not None:
            save.close()
