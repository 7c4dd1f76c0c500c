"""Saves through the writer pipeline from Python: asynchronous saves and staging pools (numpy,
anywhere), CUDA tensors read in place on torch's current stream (GPU), and sharded saves over
torch.distributed (gloo on CPU, two processes)."""

import errno
import os
import subprocess
import sys

import numpy as np
import pytest

import tensorferry as tf
import tensorferry.distributed as tfd

HERE = os.path.dirname(os.path.abspath(__file__))


def arrays(seed):
    rng = np.random.default_rng(seed)
    return {
        "a": rng.integers(0, 255, size=(3 * 4096 + 17,), dtype=np.uint8),
        "b": rng.standard_normal((64, 130)).astype(np.float32),
        "c": rng.integers(-5, 5, size=(7,), dtype=np.int64),
        "empty": np.zeros((0, 3), dtype=np.float16),
    }


def check(path, want):
    got = tf.load_file(path)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v)


@pytest.mark.parametrize("encoding", ["raw", "shuffle_zstd"])
def test_async_save_snapshots_and_commits(tmp_path, encoding):
    path = str(tmp_path / "m.ferry")
    src = arrays(1)
    want = {k: v.copy() for k, v in src.items()}
    with tf.StagingPool(1 << 20) as pool:
        fut = tf.save_file_async(src, path, metadata={"step": "3"}, encoding=encoding,
                                 block_size=4096, staging=pool)
        for v in src.values():
            v.fill(0)  # the snapshot is taken: the caller's arrays are its own again
        assert fut.result() == path
        assert fut.done() and fut.wait() and fut.exception() is None
    check(path, want)
    assert tf.read_metadata(path)["step"] == "3"
    assert os.listdir(tmp_path) == ["m.ferry"]


def test_pool_smaller_than_the_checkpoint(tmp_path):
    pool = tf.StagingPool(16384)
    assert pool.nbytes == 16384
    src = {"x%d" % i: np.full((5000 + i,), i, dtype=np.uint8) for i in range(20)}
    futures = [tf.save_file_async(src, str(tmp_path / ("f%d.ferry" % k)), staging=pool,
                                  block_size=4096) for k in range(3)]
    for k, f in enumerate(futures):
        assert f.result() == str(tmp_path / ("f%d.ferry" % k))
        check(str(tmp_path / ("f%d.ferry" % k)), src)
    pool.close()


def test_default_pool_and_sync_save_with_a_pool(tmp_path):
    src = arrays(2)
    tf.save_file_async(src, str(tmp_path / "a.ferry")).result()
    check(str(tmp_path / "a.ferry"), src)
    with tf.StagingPool(1 << 16) as pool:
        tf.save_file(src, str(tmp_path / "b.ferry"), staging=pool, block_size=4096)
    check(str(tmp_path / "b.ferry"), src)


def test_failed_async_save_raises_and_keeps_the_previous_file(tmp_path):
    target = tmp_path / "taken"

    def occupy(_written):
        # The final name becomes a non-empty directory while the save runs: the commit fails
        # after all the data was written (a directory there at the start is refused at once).
        if not target.exists():
            target.mkdir()
            (target / "keep").write_text("x")

    fut = tf.save_file_async(arrays(3), str(target), progress=occupy)
    err = fut.exception()
    assert isinstance(err, tf.InvalidArgumentError)
    assert str(target) + ": is a directory, not a regular file" in str(err)
    with pytest.raises(tf.InvalidArgumentError):
        fut.result()
    assert sorted(os.listdir(tmp_path)) == ["taken"]
    assert os.listdir(str(target)) == ["keep"]


def test_save_into_a_missing_folder_is_an_oserror_naming_the_destination(tmp_path):
    dest = tmp_path / "absent" / "m.ferry"
    for save in (tf.save_file, tf.save_file_async):
        with pytest.raises(OSError) as e:
            r = save(arrays(1), str(dest))
            if save is tf.save_file_async:
                r.result()
        assert isinstance(e.value, tf.IoError)
        assert isinstance(e.value, FileNotFoundError)
        assert e.value.errno == errno.ENOENT
        assert str(e.value).startswith(str(dest) + ": "), str(e.value)
        assert ".tmp." not in str(e.value), str(e.value)
        assert "errno 2)" in str(e.value)
    # The other writers: a conversion and a sharded index.
    src = str(tmp_path / "src.ferry")
    tf.save_file(arrays(1), src)
    dest = tmp_path / "absent" / "c.ferry"
    with pytest.raises(FileNotFoundError) as e:
        tf.convert(src, str(dest))
    assert isinstance(e.value, tf.IoError) and e.value.errno == errno.ENOENT
    assert str(e.value).startswith(str(dest) + ": "), str(e.value)
    assert ".tmp." not in str(e.value), str(e.value)
    # The index's name fits the file system's limit, its temporary file's does not.
    index = tmp_path / ("i" * 240 + ".json")
    with pytest.raises(OSError) as e:
        tfd.write_shard_index(str(index), ["src.ferry"])
    assert isinstance(e.value, tf.IoError) and e.value.errno == errno.ENAMETOOLONG
    assert str(e.value).startswith(str(index) + ": ") and ".tmp." not in str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["src.ferry"]


# Saves in a child process, printing what they raised: type names, errno and message.
_SAVE_AND_REPORT = r"""
import errno, os, resource, signal, sys
import numpy as np
import tensorferry as tf
dest = sys.argv[1]
if len(sys.argv) > 2:  # a file size limit: ignored, SIGXFSZ leaves write() to fail with EFBIG
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
src = {"a": np.arange(100000, dtype=np.float32)}
for save in (lambda: tf.save_file(src, dest + ".ferry"),
             lambda: tf.save_file_async(src, dest + ".ferry").result(),
             lambda: tf.convert(dest + ".src.ferry", dest + ".c.ferry")):
    try:
        save()
        print("saved")
    except Exception as e:
        print(isinstance(e, OSError), isinstance(e, tf.IoError), errno.errorcode.get(e.errno),
              str(e))
"""


def _child_env():
    """This process's tensorferry package and library, for a child Python."""
    from tensorferry import _lib
    package = os.path.dirname(os.path.dirname(os.path.abspath(tf.__file__)))
    path = os.pathsep.join(p for p in (package, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, TENSORFERRY_LIBRARY=_lib.library_path())


def _report(lines):
    return [line.split(" ", 3) for line in lines.strip().splitlines()]


def test_save_past_a_file_size_limit_is_an_oserror_with_efbig(tmp_path):
    dest = str(tmp_path / "m")
    tf.save_file({"a": np.arange(100000, dtype=np.float32)}, dest + ".src.ferry")
    # The limit is set by the child itself: no preexec_fn (a fork of this threaded process).
    done = subprocess.run([sys.executable, "-c", _SAVE_AND_REPORT, dest, "10000"],
                          capture_output=True, text=True, timeout=120, env=_child_env())
    assert done.returncode == 0, done.stderr
    report = _report(done.stdout)
    assert len(report) == 3, done.stdout
    for (is_os, is_io, name, message), ext in zip(report, (".ferry", ".ferry", ".c.ferry")):
        assert (is_os, is_io, name) == ("True", "True", "EFBIG"), message
        assert message.startswith(dest + ext + ": ") and ".tmp." not in message, message
    assert sorted(os.listdir(tmp_path)) == ["m.src.ferry"]


def test_save_onto_a_full_disk_is_an_oserror_with_enospc(tmp_path):
    # A small tmpfs mounted in a user namespace of its own; where the system allows none, skip.
    mount = tmp_path / "small"
    mount.mkdir()
    probe = subprocess.run(["unshare", "-rm", "sh", "-c",
                            'mount -t tmpfs -o size=64k none "$0"', str(mount)],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("no unprivileged tmpfs here: " + probe.stderr.strip())
    dest = str(mount / "m")
    # The conversion's source: small enough for the tmpfs, its output is not.
    script = ('mount -t tmpfs -o size=64k none "$0" && cp "$4" "$3.src.ferry" && '
              '"$1" -c "$2" "$3" && ls -A "$0"')
    big = str(tmp_path / "big.ferry")
    tf.save_file({"a": np.arange(100000, dtype=np.float32)}, big, encoding="shuffle_zstd")
    assert os.path.getsize(big) < 48 << 10
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script, str(mount), sys.executable,
                           _SAVE_AND_REPORT, dest, big], capture_output=True, text=True,
                          timeout=120, env=_child_env())
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    report = _report("\n".join(lines[:3]))
    for (is_os, is_io, name, message), ext in zip(report, (".ferry", ".ferry", ".c.ferry")):
        assert (is_os, is_io, name) == ("True", "True", "ENOSPC"), message
        assert message.startswith(dest + ext + ": ") and ".tmp." not in message, message
    assert lines[3:] == ["m.src.ferry"], done.stdout  # nothing else left on the full disk


@pytest.mark.parametrize("background", [False, True])
def test_progress_reports_every_byte_and_can_stop_the_save(tmp_path, background):
    path = str(tmp_path / "m.ferry")
    src = arrays(4)
    total = sum(v.nbytes for v in src.values())
    seen = []
    save = tf.save_file_async if background else tf.save_file
    out = save(src, path, encoding="shuffle_zstd", block_size=4096, durable=False,
               progress=seen.append)
    if background:
        out.result()
    check(path, src)
    assert seen == sorted(seen) and seen[-1] == total

    class Stop(Exception):
        pass

    def stop(written):
        if written >= 4096:
            raise Stop(written)

    # The callback's own exception comes back; the previous file and its folder are as they were.
    with pytest.raises(Stop):
        out = save(arrays(5), path, encoding="shuffle_zstd", block_size=4096, durable=False,
                   progress=stop)
        if background:
            out.result()
    check(path, src)
    assert os.listdir(str(tmp_path)) == ["m.ferry"]


def test_write_shard_index(tmp_path):
    tf.save_file({"a": np.arange(4, dtype=np.int32)}, str(tmp_path / "s1.ferry"))
    tf.save_file({"b": np.arange(3, dtype=np.int32)}, str(tmp_path / "s2.ferry"))
    index = str(tmp_path / "m.ferry.index.json")
    tfd.write_shard_index(index, ["s1.ferry", "s2.ferry"], {"step": "9"})
    with tfd.open_checkpoint(index) as ck:
        assert ck.keys() == ["a", "b"]
    with pytest.raises(tf.InvalidArgumentError):
        tfd.write_shard_index(index, ["s1.ferry", "s1.ferry"])


# ---- torch --------------------------------------------------------------------------------


def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or not tf.cuda_available():
        pytest.skip("no CUDA device")
    return torch


def test_cuda_tensors_are_read_on_the_current_stream(tmp_path):
    torch = _torch_cuda()
    import tensorferry.torch as tft

    dev = torch.device("cuda", torch.cuda.current_device())
    state = {
        "w": torch.randn(1024, 1031, device=dev).to(torch.bfloat16),
        "b": torch.arange(17, device=dev, dtype=torch.float32),
        "t": torch.randn(64, 32, device=dev).t(),  # not contiguous
        "e": torch.empty(0, 5, device=dev),
        "h": torch.arange(10, dtype=torch.int64),  # host
    }
    want = {k: v.detach().cpu().clone() for k, v in state.items()}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)  # keeps the stream busy: a read out of order would see 7
        state["b"].fill_(7)
        want["b"].fill_(7)
        for enc in ("raw", "shuffle_zstd"):
            path = str(tmp_path / ("m_%s.ferry" % enc))
            tft.save_state_dict(state, path, encoding=enc)
            got = tft.load_state_dict(path, device="cpu")
            for k, v in want.items():
                assert torch.equal(got[k], v), k
        fut = tft.save_state_dict_async(state, str(tmp_path / "a.ferry"))
        for v in state.values():
            v.zero_()  # after the snapshot, on the same stream
        fut.result()
    got = tft.load_state_dict(str(tmp_path / "a.ferry"), device="cpu")
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_sharded_save_over_gloo(tmp_path):
    pytest.importorskip("torch")
    script = os.path.join(HERE, "save_sharded_check.py")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    procs = [subprocess.Popen([sys.executable, script, str(r), "2", str(tmp_path), "gloo"],
                              env=env) for r in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]


# ---- destinations that are not regular files -------------------------------------------


def _not_regular_files(tmp_path):
    """{path: what the error says it is} for a FIFO, a folder, a socket and a link to
    /dev/null, made in tmp_path."""
    import socket

    # No extension: convert() is then told the format, and the destination decides the error.
    fifo, folder = tmp_path / "fifo", tmp_path / "folder"
    os.mkfifo(str(fifo))
    folder.mkdir()
    sock = tmp_path / "sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock))
    s.close()
    null = tmp_path / "null"
    os.symlink("/dev/null", str(null))
    return {str(fifo): "is a FIFO", str(folder): "is a directory", str(sock): "is a socket",
            str(null): "leads to /dev/null, which is a character device"}


def test_every_writer_refuses_a_destination_that_is_not_a_regular_file(tmp_path):
    import stat

    src = str(tmp_path / "src.ferry")
    tf.save_file({"a": np.arange(3, dtype=np.int32)}, src)
    torch_src = os.path.join(HERE, "..", "data", "torch", "pytorch_model.bin")
    specials = _not_regular_files(tmp_path)
    before = sorted(os.listdir(str(tmp_path)))
    for path, what in specials.items():
        for write in (lambda p: tf.save_file({"a": np.arange(3, dtype=np.int32)}, p),
                      lambda p: tf.save_file_async({"a": np.zeros(2)}, p).result(),
                      lambda p: tf.convert(src, p, to="ferry"),
                      lambda p: tf.convert(torch_src, p, to="ferry"),
                      lambda p: tf.convert(torch_src, p, to="safetensors"),
                      lambda p: tfd.write_shard_index(p, ["src.ferry"])):
            with pytest.raises(tf.InvalidArgumentError, match="not a regular file") as e:
                write(path)
            assert path + ": " + what in str(e.value)
            assert sorted(os.listdir(str(tmp_path))) == before
    assert stat.S_ISFIFO(os.lstat(str(tmp_path / "fifo")).st_mode)
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
