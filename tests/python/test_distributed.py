"""tensorferry.distributed: the split plan and sharded indexes anywhere; the two-process check
(tests/python/distributed_check.py under torchrun) where torch.distributed and two GPUs exist."""

import json
import os
import subprocess
import sys

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
