"""Host loads from Python: load_file hands out raw tensors as views of one private
copy-on-write mapping of the file (no copy, like safetensors' torch loads), decodes the
others with the library's workers into one buffer, takes threads= and verify=, and load_iter
works without a GPU. Needs no torch; test_torch.py checks the torch CPU forms."""

import ctypes
import os

import numpy as np
import pytest

import tensorferry as tf
from tensorferry import _dtypes, _lib


def mixed_file(path):
    """Raw, zstd and empty tensors in one file, through the C writer (save_file takes one
    encoding for all)."""
    rng = np.random.default_rng(7)
    tensors = {
        "a.raw": (rng.standard_normal((64, 33)).astype(np.float32), "raw"),
        "b.zstd": (np.arange(5000, dtype=np.int64), "zstd"),
        "c.raw": (rng.integers(0, 255, 4099, dtype=np.uint8), "raw"),
        "d.empty": (np.zeros((0, 3), np.float16), "raw"),
        "f.empty": (np.zeros((4, 0), np.int32), "zstd"),
        "e.shuffled": (np.linspace(0, 1, 3000, dtype=np.float32), "shuffle+zstd"),
    }
    h = ctypes.c_void_p()
    opts = _lib.writer_options("raw", block_size=4096)
    _lib.call("ferry_writer_create", path.encode(), ctypes.byref(opts), ctypes.byref(h))
    try:
        for name, (a, enc) in tensors.items():
            shape = (ctypes.c_int64 * max(1, a.ndim))(*a.shape)
            _lib.call("ferry_writer_add_tensor", h, name.encode(),
                      _dtypes.code(_dtypes.from_numpy(a.dtype)), shape, a.ndim,
                      ctypes.c_void_p(a.ctypes.data), a.nbytes, _lib.encoding_code(enc))
        _lib.call("ferry_writer_commit", h)
    finally:
        _lib.lib().ferry_writer_free(h)
    return {k: v for k, (v, _) in tensors.items()}


def flip_byte(path, offset):
    """Corrupts one byte of the file at `path` in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def root(a):
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


@pytest.mark.parametrize("threads", [0, 1, 3])
def test_raw_tensors_are_views_of_one_private_mapping(tmp_path, threads):
    path = str(tmp_path / "m.ferry")
    want = mixed_file(path)
    before = open(path, "rb").read()
    got = tf.load_file(path, threads=threads)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v)
        assert got[k].flags.writeable, k
    # Every raw tensor lies in one mapping of the whole file; the compressed ones in one
    # buffer the library filled.
    raw_roots = {id(root(got[k])) for k in ("a.raw", "c.raw")}
    assert len(raw_roots) == 1 and root(got["a.raw"]).nbytes == os.path.getsize(path)
    assert {id(root(got[k])) for k in ("b.zstd", "e.shuffled")} != raw_roots
    # Writes stay in this load: not in the file, not in another load.
    for v in got.values():
        v[...] = 0
    assert open(path, "rb").read() == before
    again = tf.load_file(path)
    for k, v in want.items():
        np.testing.assert_array_equal(again[k], v)
    del got, again  # the mappings go with the arrays


def test_verify_checks_every_tensor_and_catches_a_flipped_byte(tmp_path):
    path = str(tmp_path / "m.ferry")
    want = mixed_file(path)
    for k, v in tf.load_file(path, verify=True, threads=2).items():
        np.testing.assert_array_equal(v, want[k])
    with tf.Reader(path) as r:
        flip_byte(path, r.info("c.raw").data_offset + 100)
    with pytest.raises(tf.DataLossError, match="'c.raw'"):
        tf.load_file(path, verify=True)
    tf.load_file(path)  # unverified: the views are handed out as they are


def test_a_safetensors_file_loads_as_views_too(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    want = {"w": np.arange(12, dtype=np.float32).reshape(3, 4),
            "b": np.arange(5, dtype=np.int16)}
    path = str(tmp_path / "m.safetensors")
    safetensors_numpy.save_file(want, path)
    got = tf.load_file(path)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v)
    assert root(got["w"]).nbytes == os.path.getsize(path)


def test_load_iter_on_the_host(tmp_path):
    path = str(tmp_path / "m.ferry")
    want = mixed_file(path)
    seen = {}
    for name, t in tf.load_iter(path, device="cpu"):
        assert name not in seen
        seen[name] = t
    assert sorted(seen) == sorted(want)
    for k, v in want.items():
        np.testing.assert_array_equal(seen[k], v)
    # Leaving early closes cleanly.
    it = tf.load_iter(path, device="cpu", verify=True)
    next(it)
    it.close()
