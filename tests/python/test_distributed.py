"""tensorferry.distributed: the split plan, sharded indexes, and the library's sharded save and
distributed plan over a group of threads (the collective is the module's hook, so no torch is
needed); the two-process check (tests/python/distributed_check.py under torchrun) where
torch.distributed and two GPUs exist."""

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import tensorferry as tf
import tensorferry.distributed as tfd

HERE = os.path.dirname(os.path.abspath(__file__))


def covers(items, pieces, segments):
    nxt = [0] * len(items)
    last = 0
    for item, seg, begin, length in pieces:
        assert begin == nxt[item] and length > 0
        assert last <= seg < segments
        last = seg
        n, row = items[item]
        if (begin, length) != (0, n):
            assert row and begin % row == 0 and length % row == 0
        nxt[item] += length
    assert nxt == [n for n, _ in items]


def seg_bytes(pieces, segments):
    out = [0] * segments
    for _, seg, _, length in pieces:
        out[seg] += length
    return out


# The same cases as SplitPlanTest (tests/distributed_test.cc): Python and C++ split alike.
def test_split_plan_matches_the_cpp_cases():
    items = [(1000 * 64, 64)]
    pieces = tfd.split_plan(items, 2, 1)
    covers(items, pieces, 2)
    assert pieces == [(0, 0, 0, 500 * 64), (0, 1, 500 * 64, 500 * 64)]
    items = [(200, 0), (0, 0), (300, 300), (100, 10)]
    assert seg_bytes(tfd.split_plan(items, 2, 1), 2) == [200, 400]
    assert seg_bytes(tfd.split_plan([(100, 0), (300, 300), (100, 10)], 2, 1), 2) == [400, 100]
    items = [(4096 * (1 + i % 7), 4096) for i in range(50)]
    total = sum(n for n, _ in items)
    for ranks in (1, 2, 3, 8):
        for rounds in (1, 4):
            pieces = tfd.split_plan(items, ranks, rounds)
            covers(items, pieces, ranks * rounds)
            for b in seg_bytes(pieces, ranks * rounds):
                assert abs(b - total // (ranks * rounds)) <= 4096
    assert tfd.split_plan([], 2, 4) == []
    assert sum(p[3] for p in tfd.split_plan([(3, 1)], 4, 2)) == 3


def write_sharded(tmp_path):
    a = {"a": np.arange(10, dtype=np.float32), "b": np.ones((3, 4), dtype=np.int64)}
    c = {"c": np.zeros(7, dtype=np.uint8)}
    tf.save_file(a, str(tmp_path / "x.ferry"), durable=False)
    tf.save_file(c, str(tmp_path / "y.ferry"), durable=False)
    index = tmp_path / "m.ferry.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "x.ferry", "b": "x.ferry", "c": "y.ferry"}}))
    return index


def test_open_checkpoint_sharded(tmp_path):
    index = write_sharded(tmp_path)
    with tfd.open_checkpoint(index) as ck:
        assert ck.keys() == ["a", "b", "c"]
        assert ck.reader("c").info("c").nbytes == 7
        with pytest.raises(tf.NotFoundError):
            ck.reader("zz")
    with tfd.open_checkpoint(tmp_path / "x.ferry") as ck:
        assert ck.keys() == ["a", "b"]


@pytest.mark.parametrize("weight_map, message", [
    ({"a": "../x.ferry"}, "not a relative path"),
    ({"a": "x.ferry", "c": "y.ferry"}, "tensor 'b' of 'x.ferry' is not in the weight_map"),
    ({"a": "x.ferry", "b": "y.ferry", "c": "y.ferry"},
     "maps tensor 'b' to 'y.ferry', which has no such tensor"),
])
def test_open_checkpoint_rejects(tmp_path, weight_map, message):
    write_sharded(tmp_path)
    bad = tmp_path / "bad.index.json"
    bad.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(tf.DataLossError, match=message):
        tfd.open_checkpoint(bad)


def test_open_checkpoint_parses_strictly(tmp_path):
    # The library's parser, not json.loads: a duplicate key is an error, not "last one wins".
    write_sharded(tmp_path)
    bad = tmp_path / "dup.index.json"
    bad.write_text('{"weight_map": {"a": "x.ferry", "a": "y.ferry", "b": "x.ferry", '
                   '"c": "y.ferry"}}')
    with pytest.raises(tf.DataLossError, match="bad checkpoint index: duplicate key 'a'"):
        tfd.open_checkpoint(bad)


class ThreadGroup:
    """The ranks of a group as threads of this process: reduce() is their all-reduce (max)."""

    def __init__(self, nranks):
        self.nranks = nranks
        self.calls = 0
        self._cond = threading.Condition()
        self._arrived = 0
        self._generation = 0
        self._acc = self._result = None

    def reduce(self, words):
        with self._cond:
            self.calls += 1
            self._acc = list(words) if self._arrived == 0 else \
                [max(a, b) for a, b in zip(self._acc, words)]
            generation = self._generation
            self._arrived += 1
            if self._arrived == self.nranks:
                self._result, self._arrived = self._acc, 0
                self._generation += 1
                self._cond.notify_all()
            elif not self._cond.wait_for(lambda: self._generation != generation, timeout=60):
                raise TimeoutError("a rank never arrived")
            return list(self._result)


def on_ranks(nranks, fn):
    """fn(rank, collective) on one thread per rank; the results (or exceptions), by rank."""
    group = ThreadGroup(nranks)
    out = [None] * nranks

    def run(rank):
        try:
            out[rank] = fn(rank, tfd._Collective(group.reduce))
        except BaseException as e:  # noqa: B902 - compared by the test
            out[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(nranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def save_sharded(tmp_path, tensors_of, generation, **kwargs):
    index = str(tmp_path / "model.ferry.index.json")
    options = dict(metadata={"generation": str(generation)}, encoding="raw", zstd_level=None,
                   durable=False, scaling_state=None, async_save=False, staging=None,
                   remove_replaced=True)
    options.update(kwargs)
    return index, on_ranks(2, lambda r, c: tfd._save_sharded(tensors_of(r), index, r, 2, c,
                                                             **options))


def rank_tensors(rank, generation):
    return {"r%d.w" % rank: np.arange(1000 + rank, dtype=np.float32) * generation,
            "r%d.i" % rank: np.full((3, 5), rank + generation, dtype=np.int64)}


@pytest.mark.parametrize("async_save", [False, True])
def test_sharded_save_over_a_group_of_threads(tmp_path, async_save):
    for generation in (1, 2):
        index, got = save_sharded(tmp_path, lambda r: rank_tensors(r, generation), generation,
                                  async_save=async_save)
        if async_save:
            assert all(isinstance(f, tfd.ShardedSaveFuture) for f in got), got
            got = on_ranks(2, lambda r, c: got[r].result())  # collective
        assert got == [index, index]
        shards = sorted(f for f in os.listdir(tmp_path) if f.endswith(".ferry"))
        # The library names the shards, and the replaced generation's are gone.
        assert len(shards) == 2, shards
        assert all(f.startswith("model-") and f.endswith("-of-00002.ferry") for f in shards)
        with open(index) as f:
            text = json.load(f)
        assert text["metadata"]["generation"] == str(generation)
        with tfd.open_checkpoint(index) as ck:
            assert ck.keys() == ["r0.i", "r0.w", "r1.i", "r1.w"]
            for r in range(2):
                for name, want in rank_tensors(r, generation).items():
                    reader = ck.reader(name)
                    assert reader.metadata() == {"generation": str(generation)}
                    np.testing.assert_array_equal(tf.load_file(reader.path)[name], want)


def test_sharded_save_fails_on_every_rank_and_keeps_the_previous(tmp_path):
    index, got = save_sharded(tmp_path, lambda r: rank_tensors(r, 1), 1)
    assert got == [index, index]
    before = sorted(os.listdir(tmp_path))
    # Rank 1 cannot add its tensors: both ranks fail, nothing new stays behind.
    bad = lambda r: rank_tensors(r, 2) if r == 0 else {"x": object()}
    _, got = save_sharded(tmp_path, bad, 2)
    assert isinstance(got[1], TypeError), got
    assert isinstance(got[0], tf.FerryError), got
    assert "rank 0: another rank failed to write its shard" in str(got[0])
    assert sorted(os.listdir(tmp_path)) == before
    with tfd.open_checkpoint(index) as ck:
        assert ck.reader("r0.w").metadata() == {"generation": "1"}


def test_sharded_save_raises_what_the_collective_raised(tmp_path):
    def broken(words):
        raise ConnectionError("the group went away")

    with pytest.raises(ConnectionError, match="the group went away"):
        tfd._save_sharded({"a": np.zeros(3)}, str(tmp_path / "m.ferry.index.json"), 0, 1,
                          tfd._Collective(broken), metadata=None, encoding="raw",
                          zstd_level=None, durable=False, scaling_state=None, async_save=False,
                          staging=None, remove_replaced=True)
    assert os.listdir(tmp_path) == []


def test_distributed_plan_over_a_group_of_threads(tmp_path):
    index = write_sharded(tmp_path)
    big = {"big": np.arange(3 << 18, dtype=np.float32).reshape(-1, 64)}  # 3 MiB: its own buffer
    tf.save_file(big, str(tmp_path / "z.ferry"), durable=False)
    index.write_text(json.dumps({"weight_map": {"a": "x.ferry", "b": "x.ferry", "c": "y.ferry",
                                                "big": "z.ferry"}}))

    def plan(rank, collective):
        with tfd.open_checkpoint(index) as ck, \
                tfd._Plan(ck, None, {}, rank, 2, 2, True, collective) as p:
            p.conclude(False)
            return p.items, p.arena_bytes, p.broadcasts, p.reads

    got = on_ranks(2, plan)
    for g in got:
        assert not isinstance(g, BaseException), g
    (items, arena, broadcasts, _), (items1, arena1, broadcasts1, _) = got
    assert [i.name for i in items] == [i.name for i in items1] == ["a", "b", "c", "big"]
    assert arena == arena1 and broadcasts == broadcasts1  # the same calls on every rank
    own = {i.name: i.arena_offset for i in items}
    assert own["big"] is None and own["a"] == 0 and own["b"] == 256
    # Every byte is read once, by one rank, into its place.
    covered = [0] * len(items)
    for _, _, _, reads in got:
        for k in range(2):
            for item, begin, nbytes, rows in reads[k]:
                assert begin == covered[item]
                covered[item] += nbytes
    assert covered == [i.nbytes for i in items]


def test_distributed_plan_failures_reach_every_rank(tmp_path):
    index = write_sharded(tmp_path)

    def plan(rank, collective):
        names = ["a", "b"] if rank == 0 else ["a", "zz"]
        with tfd.open_checkpoint(index) as ck:
            tfd._Plan(ck, names, {}, rank, 2, 4, True, collective).close()

    got = on_ranks(2, plan)
    assert isinstance(got[1], tf.NotFoundError) and "'zz'" in str(got[1])
    assert isinstance(got[0], tf.InvalidArgumentError)
    assert "rank 0: the ranks disagree on the replicated requests" in str(got[0])

    def conclude(rank, collective):
        with tfd.open_checkpoint(index) as ck, \
                tfd._Plan(ck, None, {"c": None}, rank, 2, 4, True, collective) as p:
            p.conclude(rank == 1)

    got = on_ranks(2, conclude)
    assert "rank 0: another rank failed this distributed load" in str(got[0])
    assert "rank 1: this rank failed" in str(got[1])


def test_load_file_needs_an_initialized_group(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialized")
    with pytest.raises(RuntimeError, match="not initialized"):
        tfd.load_file(write_sharded(tmp_path))


def test_two_ranks_under_torchrun():
    torch = pytest.importorskip("torch")
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_nccl_available():
        pytest.skip("torch.distributed without NCCL")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(HERE, "distributed_check.py"), "--gib", "0"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    print(r.stdout[-4000:], r.stderr[-4000:])
    if r.returncode == 77:
        pytest.skip("distributed check skipped itself")
    assert r.returncode == 0
    assert "distributed check: PASS" in r.stdout
