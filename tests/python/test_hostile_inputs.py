"""Hostile and unusual inputs at the Python boundary: strings the C library would cut at a NUL,
bytes that are not UTF-8, malformed sharded indexes, slicing against numpy's rules, byte order,
resource exhaustion, non-regular files and replaced files' permissions. Needs no GPU."""

import ctypes
import json
import os
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import tensorferry as tf
from tensorferry import _lib

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402

PKG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bindings", "python")


def run_python(code, timeout=60):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.abspath(PKG) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=env)


# ---- slicing (item 4) ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def sliced_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("slices")
    a = np.arange(7 * 3, dtype=np.float32).reshape(7, 3)
    out = {}
    for enc in ("raw", "zstd"):
        p = d / ("s_%s.ferry" % enc)
        tf.save_file({"a": a, "v": np.arange(5, dtype=np.int16)}, p, encoding=enc,
                     block_size=4096)
        out[enc] = p
    return a, out


@pytest.mark.parametrize("enc", ["raw", "zstd"])
@pytest.mark.parametrize("key", [slice(None, None, -1), slice(3, None, -1), slice(None, None, -2),
                                 slice(5, 1, -2), slice(-1, -7, -3), slice(1, 6, 2),
                                 slice(6, 0, -1), slice(6, -7, -1), slice(2, 2, -1)])
def test_get_slice_steps_match_numpy(sliced_files, enc, key):
    a, files = sliced_files
    with tf.safe_open(files[enc]) as f:
        got = f.get_slice("a")[key]
        np.testing.assert_array_equal(got, a[key])
        assert got.shape == a[key].shape
        got = f.get_slice("a")[key, 1:]
        np.testing.assert_array_equal(got, a[key, 1:])


@settings(max_examples=150, deadline=None)
@given(rows=st.integers(0, 9), cols=st.integers(1, 3), start=st.none() | st.integers(-14, 14),
       stop=st.none() | st.integers(-14, 14),
       step=st.none() | st.integers(-5, 5).filter(lambda s: s != 0),
       index=st.integers(-12, 12), enc=st.sampled_from(["raw", "zstd"]))
def test_get_slice_property(tmp_path_factory, rows, cols, start, stop, step, index, enc):
    a = np.arange(rows * cols, dtype=np.int32).reshape(rows, cols)
    p = tmp_path_factory.mktemp("prop") / "p.ferry"
    tf.save_file({"a": a}, p, encoding=enc, block_size=4096, durable=False)
    key = slice(start, stop, step)
    # Slice bounds clamp, as in Python and numpy; only int indices raise.
    with tf.safe_open(p) as f:
        got = f.get_slice("a")[key]
        assert got.shape == a[key].shape
        np.testing.assert_array_equal(got, a[key])
        if -rows <= index < rows:
            np.testing.assert_array_equal(f.get_slice("a")[index], a[index])
            np.testing.assert_array_equal(f.get_slice("a")[index, ::-1], a[index, ::-1])
        else:
            with pytest.raises(IndexError):
                f.get_slice("a")[index]


# ---- NUL bytes at the C boundary (item 5) ---------------------------------------------------


def test_nul_in_tensor_name_refused(tmp_path):
    p = tmp_path / "m.ferry"
    with pytest.raises(ValueError, match="NUL"):
        tf.save_file({"layer\0.weight": np.zeros(2)}, p)
    assert not p.exists()
    assert not list(tmp_path.iterdir())  # no temporary file left either
    tf.save_file({"a": np.zeros(2)}, p)
    with tf.safe_open(p) as f:
        with pytest.raises(ValueError, match="NUL"):
            f.get_tensor("a\0b")


def test_nul_in_metadata_refused(tmp_path):
    p = tmp_path / "m.ferry"
    for md in ({"k\0a": "1", "k\0b": "2"}, {"k": "v\0w"}):
        with pytest.raises(ValueError, match="NUL"):
            tf.save_file({"a": np.zeros(2)}, p, metadata=md)
    assert not p.exists()
    with pytest.raises(ValueError, match="NUL"):
        tf.save_file({"a": np.zeros(2)}, p, producer="me\0you")


def test_nul_in_path_refused(tmp_path):
    target = tmp_path / "model.ferry"
    tf.save_file({"a": np.ones(2)}, target)
    with pytest.raises(ValueError, match="NUL"):
        tf.save_file({"a": np.zeros(2)}, str(target) + "\0.bak")
    np.testing.assert_array_equal(tf.load_file(target)["a"], np.ones(2))
    for fn in (tf.load_file, tf.read_metadata, tf.safe_open):
        with pytest.raises(ValueError, match="NUL"):
            fn(str(target) + "\0.bak")


def write_safetensors(path, header, data=b""):
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


def test_safetensors_metadata_value_with_nul_read_whole(tmp_path):
    p = tmp_path / "n.safetensors"
    write_safetensors(p, {"__metadata__": {"k": "before\u0000after"},
                          "t": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, b"ab")
    assert tf.read_metadata(p) == {"k": "before\0after"}


# ---- clear errors (item 11) -----------------------------------------------------------------


def c_write(path, name, key=b"k", value=b"v"):
    """Writes through the C API directly (bytes, not str), as another binding might."""
    L = _lib.lib()
    opts = _lib.WriterOptions()
    L.ferry_writer_options_init(ctypes.byref(opts))
    h = ctypes.c_void_p()
    _lib.call("ferry_writer_create", os.fsencode(path), ctypes.byref(opts), ctypes.byref(h))
    try:
        shape = (ctypes.c_int64 * 1)(4)
        buf = (ctypes.c_uint8 * 4)(1, 2, 3, 4)
        _lib.call("ferry_writer_add_tensor", h, name, 1, shape, 1, ctypes.cast(buf, ctypes.c_void_p),
                  4, _lib.ENCODING_DEFAULT)
        _lib.call("ferry_writer_set_metadata", h, key, value)
        _lib.call("ferry_writer_commit", h)
    finally:
        L.ferry_writer_free(h)


def test_non_utf8_name_is_a_clear_error(tmp_path):
    p = tmp_path / "u.ferry"
    c_write(p, b"bad\xff")
    with pytest.raises(tf.DataLossError, match=r"u\.ferry.*tensor #0 name.*not valid UTF-8"):
        tf.load_file(p)


def test_non_utf8_metadata_is_a_clear_error(tmp_path):
    p = tmp_path / "u.ferry"
    c_write(p, b"t", b"key", b"\xc3(")
    with pytest.raises(tf.DataLossError, match=r"metadata value of 'key'.*not valid UTF-8"):
        tf.read_metadata(p)


def test_null_destination_says_so(tmp_path):
    p = tmp_path / "d.ferry"
    tf.save_file({"a": np.zeros(2, np.float32)}, p)
    with tf.Reader(p) as r:
        for fn, args in (("ferry_reader_read_into", (b"a", None, 8, 0)),
                         ("ferry_reader_read_rows_into", (b"a", 0, 2, None, 8, 0))):
            with pytest.raises(tf.InvalidArgumentError, match="dst must not be NULL"):
                _lib.call(fn, r.handle, *args)


@pytest.mark.parametrize("dtype", [">f4", ">i8", ">u2", ">c8", ">f8"])
def test_big_endian_arrays_are_stored_little_endian(tmp_path, dtype):
    a = (np.arange(6) * 3 - 7).astype(dtype).reshape(2, 3)
    p = tmp_path / "be.ferry"
    tf.save_file({"a": a}, p)
    got = tf.load_file(p)["a"]
    assert got.dtype.isnative
    np.testing.assert_array_equal(got, a)


def sharded(tmp_path, text):
    tf.save_file({"w": np.ones(2, np.float32)}, tmp_path / "s-1.ferry")
    p = tmp_path / "model.ferry.index.json"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return p


@pytest.mark.parametrize("text", [
    '{"weight_map": {"w": ["s-1.ferry"]}}',
    '{"weight_map": {"w": {"a": 1}}}',
    '{"weight_map": {"w": 3}}',
    '{"weight_map": ' + "[" * 100000 + "]" * 100000 + "}",
    '{"metadata": ' + "[" * 100000 + "]" * 100000 + ', "weight_map": {"w": "s-1.ferry"}}',
    b'{"weight_map": {"w": "s-1.ferry\xff"}}',
    '{"weight_map": {"w": "s-1.ferry"',
])
def test_malformed_sharded_index_names_the_file(tmp_path, text):
    import tensorferry.distributed as tfd

    p = sharded(tmp_path, text)
    with pytest.raises(tf.DataLossError, match=r"model\.ferry\.index\.json"):
        tfd.open_checkpoint(p)


# ---- resources, non-regular files, replaced files (items 3, 7, 12) --------------------------


def test_thread_creation_failure_is_resource_exhausted(tmp_path):
    p = tmp_path / "t.ferry"
    r = run_python("""
        import resource, sys, numpy as np, tensorferry as tf
        a = np.arange(1 << 20, dtype=np.float32)
        tf.version()
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
        try:
            tf.save_file({"a": a}, sys.argv[1] if len(sys.argv) > 1 else %r, encoding="zstd",
                         block_size=4096, threads=40000)
        except tf.ResourceExhaustedError as e:
            print("RESOURCE", e)
    """ % str(p))
    assert r.returncode == 0, r.stderr
    assert "RESOURCE" in r.stdout and "thread" in r.stdout, r.stdout
    assert not list(tmp_path.iterdir()), list(tmp_path.iterdir())


def test_named_pipe_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.ferry"
    os.mkfifo(fifo)
    r = run_python("""
        import tensorferry as tf
        for fn in (tf.load_file, tf.read_metadata):
            try:
                fn(%r)
            except tf.InvalidArgumentError as e:
                print("REFUSED", e)
    """ % str(fifo), timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("not a regular file") == 2, r.stdout


def test_replaced_file_keeps_its_mode(tmp_path):
    p = tmp_path / "private.ferry"
    tf.save_file({"a": np.zeros(2)}, p)
    os.chmod(p, 0o600)
    tf.save_file({"a": np.ones(2)}, p)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    np.testing.assert_array_equal(tf.load_file(p)["a"], np.ones(2))


# ---- the `ferry` command (items 1, 2, 3, 8, 11, 12, 13) -------------------------------------


def find_ferry():
    import glob

    if os.environ.get("FERRY_BIN"):
        return os.environ["FERRY_BIN"]
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    candidates = []
    if os.environ.get("FERRY_BUILD_DIR"):
        candidates.append(os.path.join(os.environ["FERRY_BUILD_DIR"], "src", "cli", "ferry"))
    candidates += sorted(glob.glob(os.path.join(root, "build*", "src", "cli", "ferry")),
                         key=os.path.getmtime, reverse=True)
    return next((c for c in candidates if os.access(c, os.X_OK)), None)


FERRY = find_ferry()
needs_ferry = pytest.mark.skipif(FERRY is None, reason="no built `ferry` (set FERRY_BIN)")


def ferry(*args, limit_kib=None, timeout=120):
    cmd = [FERRY, *map(str, args)]
    if limit_kib is not None:
        cmd = ["bash", "-c", 'ulimit -v %d && exec "$@"' % limit_kib, "ferry", *cmd]
    return subprocess.run(cmd, capture_output=True, timeout=timeout)


FP8_Q = ('[{"name":"w","quantized_dtype":"F8_E4M3FN","logical_dtype":"BF16","shape":[2,4],'
         '"scaling_mode":"per-tensor","rowwise":{"data":"%s","scale_inv":null,'
         '"scale_layout":"row-major","amax":null},"columnwise":null}]')


@needs_ferry
def test_cli_convert_sharded_index_with_deep_metadata(tmp_path):
    write_safetensors(tmp_path / "s1.safetensors",
                      {"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, b"ab")
    idx = tmp_path / "model.safetensors.index.json"
    idx.write_text('{"metadata": {"x": ' + "[" * 100000 + "]" * 100000 +
                   '}, "weight_map": {"a": "s1.safetensors"}}')
    p = ferry("convert", idx, tmp_path / "out.ferry")
    assert p.returncode == 1, (p.returncode, p.stderr)  # not a crash (-11)
    assert b"model.safetensors.index.json" in p.stderr and b"nests deeper" in p.stderr
    assert not (tmp_path / "out.ferry").exists()


DEEP_DESCRIPTIONS = {"lists": "[" * 100000 + "]" * 100000,
                     "objects": "[" + '{"a":' * 50000 + "1" + "}" * 50000 + "]"}


@needs_ferry
# Short ids: pytest puts a test's id into the environment (PYTEST_CURRENT_TEST) of every
# process the test starts, and some pytest versions make ids of the values themselves; a
# 200 KB value there fails the exec ("Argument list too long"). The description reaches
# `ferry` in the file only.
@pytest.mark.parametrize("kind", sorted(DEEP_DESCRIPTIONS))
def test_cli_convert_deep_fp8_description(tmp_path, kind):
    value = DEEP_DESCRIPTIONS[kind]
    src = tmp_path / "deep.safetensors"
    write_safetensors(src, {"__metadata__": {"tensorferry.scaling": value},
                            "t": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, b"xy")
    p = ferry("convert", src, tmp_path / "out.ferry")
    assert p.returncode == 0, (p.returncode, p.stderr)
    assert b"kept as plain metadata" in p.stderr and b"nests deeper" in p.stderr
    assert tf.read_metadata(tmp_path / "out.ferry")["tensorferry.scaling"] == value
    assert ferry("inspect", src).returncode == 0


@needs_ferry
def test_cli_invalid_fp8_description_blames_the_input(tmp_path):
    src = tmp_path / "in.safetensors"
    write_safetensors(src, {"__metadata__": {"tensorferry.quantized": FP8_Q % "missing"},
                            "t": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}}, b"xy")
    out = tmp_path / "out.ferry"
    p = ferry("convert", src, out)
    assert p.returncode == 1
    err = p.stderr.decode()
    assert str(src) + ": metadata 'tensorferry.quantized'" in err, err
    assert "'missing'" in err and str(out) not in err, err
    assert not list(tmp_path.glob("out.ferry*"))


@needs_ferry
def test_cli_inspect_escapes_everything_from_the_file(tmp_path):
    src = tmp_path / "esc.safetensors"
    evil = "\x1b]0;owned\x07\x1b[2J\u009b31m\x7f"
    write_safetensors(src, {"__metadata__": {"k" + evil: "v" + evil},
                            "n" + evil: {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}},
                      b"xy")
    for args in (("inspect", src), ("inspect", "--json", src)):
        p = ferry(*args)
        assert p.returncode == 0, p.stderr
        out = p.stdout
        for bad in (b"\x1b", b"\x07", b"\x7f", "\u009b".encode()):
            assert bad not in out, (args, out)
        if "--json" in args:
            info = json.loads(out)
            assert info["metadata"] == {"k" + evil: "v" + evil}
        else:
            assert b"k\\x1b]0;owned\\x07\\x1b[2J\\xc2\\x9b31m\\x7f = v\\x1b" in out, out
            assert b"n\\x1b]0;owned" in out, out
    # The mode kept on conversion over an existing private file (item 12).
    dst = tmp_path / "private.ferry"
    dst.write_bytes(b"old")
    os.chmod(dst, 0o600)
    assert ferry("convert", src, dst).returncode == 0
    assert stat.S_IMODE(os.stat(dst).st_mode) == 0o600


@needs_ferry
def test_cli_tiny_safetensors_files(tmp_path):
    for name, data in (("empty.safetensors", (0).to_bytes(8, "little")),
                       ("list.safetensors", (2).to_bytes(8, "little") + b"[]")):
        p = ferry("inspect", tmp_path / name) if (tmp_path / name).write_bytes(data) else None
        assert p.returncode == 1
        assert b"safetensors header" in p.stderr and b"TensorFerry" not in p.stderr, p.stderr


@needs_ferry
def test_cli_convert_threads_under_an_address_space_limit(tmp_path):
    src = tmp_path / "in.ferry"
    tf.save_file({"a": np.arange(1 << 16, dtype=np.float32)}, src)
    out = tmp_path / "out.ferry"
    p = ferry("convert", "--encoding", "zstd", "--block-size", "4KiB", "--threads", "256", src,
              out, limit_kib=1 << 20)
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert b"ResourceExhausted" in p.stderr and b"thread" in p.stderr, p.stderr
    assert sorted(os.listdir(tmp_path)) == ["in.ferry"]


@needs_ferry
def test_cli_verify_allocation_failure_is_an_error(tmp_path):
    # 256 MiB zstd blocks of zeros: a few KiB of file; decoding one needs its 256 MiB.
    src = tmp_path / "zeros.ferry"
    tf.save_file({"z": np.zeros(1 << 26, np.float32)}, src, encoding="zstd", block_size=1 << 28)
    assert ferry("verify", src).returncode == 0
    p = ferry("verify", src, limit_kib=200 << 10)
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert b"ResourceExhausted" in p.stderr, p.stderr
