"""tensorferry with numpy (+ ml_dtypes): round trips of every dtype, metadata, safe_open,
zero-copy views, DLPack export, scaling state, and errors. Needs no GPU and no torch."""

import os

import numpy as np
import pytest

import tensorferry as tf
from corrupt import flip_data_byte
import tensorferry.numpy  # noqa: F401  (tf.numpy)

ml_dtypes = pytest.importorskip("ml_dtypes")

NATIVE = {
    "BOOL": np.bool_, "U8": np.uint8, "U16": np.uint16, "U32": np.uint32, "U64": np.uint64,
    "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64, "F16": np.float16,
    "F32": np.float32, "F64": np.float64, "C64": np.complex64, "C128": np.complex128,
}
NARROW = {
    "BF16": ml_dtypes.bfloat16, "F8_E4M3FN": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2, "F8_E8M0FNU": ml_dtypes.float8_e8m0fnu,
    "F8_E4M3FNUZ": ml_dtypes.float8_e4m3fnuz, "F8_E5M2FNUZ": ml_dtypes.float8_e5m2fnuz,
    "F6_E2M3FN": ml_dtypes.float6_e2m3fn, "F6_E3M2FN": ml_dtypes.float6_e3m2fn,
    "F4_E2M1FN": ml_dtypes.float4_e2m1fn,
}


def sample(dtype, shape=(3, 5), seed=0):
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if dtype == np.bool_:
        return (rng.integers(0, 2, n) == 1).reshape(shape)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -100), min(info.max, 100), n).astype(dtype).reshape(shape)
    if np.issubdtype(dtype, np.complexfloating):
        return (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dtype).reshape(shape)
    if dtype == ml_dtypes.float8_e8m0fnu:  # exponent-only: powers of two
        return (2.0 ** rng.integers(-8, 8, n)).astype(dtype).reshape(shape)
    return rng.uniform(-4, 4, n).astype(dtype).reshape(shape)


def assert_same(a, b):
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    # Compare bit patterns: exact, and NaN-safe.
    assert np.array_equal(np.ascontiguousarray(a).view(np.uint8),
                          np.ascontiguousarray(b).view(np.uint8))


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "model.ferry")


@pytest.mark.parametrize("name", sorted(NATIVE) + sorted(NARROW))
@pytest.mark.parametrize("encoding", ["raw", "shuffle_zstd"])
def test_round_trip_every_dtype(path, name, encoding):
    dtype = NATIVE.get(name) or NARROW[name]
    shape = (3, 5) if name != "F4_E2M1FN" else (3, 5)  # 15 FP4 elements: odd, 8 bytes
    arrays = {"x": sample(dtype, shape), "scalar": sample(dtype, ()),
              "empty": np.zeros((0, 4), dtype)}
    tf.save_file(arrays, path, encoding=encoding)
    with tf.safe_open(path, framework="np") as f:
        assert f.info("x").dtype == name
        assert f.info("x").shape == shape
        assert f.info("x").nbytes == (8 if name == "F4_E2M1FN" else arrays["x"].nbytes)
        for k, v in arrays.items():
            assert_same(f.get_tensor(k), v)
    loaded = tf.load_file(path)
    assert sorted(loaded) == sorted(arrays)
    for k, v in arrays.items():
        assert_same(loaded[k], v)
        assert loaded[k].flags.writeable


def test_many_tensors_described_in_one_call(path):
    # Names, dtypes and shapes come from one table call; load_file fills one packed buffer.
    kinds = [(np.float32, (3, 2)), (ml_dtypes.bfloat16, (5,)), (np.int64, ()),
             (np.uint8, (0, 7)), (ml_dtypes.float4_e2m1fn, (3,)), (np.float16, (2, 2, 2))]
    arrays = {}
    for i in range(3000):
        dtype, shape = kinds[i % len(kinds)]
        arrays["layer.%d.é%d" % (i // 7, i % 7)] = sample(dtype, shape, seed=i)
    tf.save_file(arrays, path, durable=False)
    with tf.Reader(path) as r:
        keys = r.keys()
        assert keys == sorted(arrays, key=lambda k: k.encode("utf-8"))
        for k in keys[::97]:
            info = r.info(k)
            assert info.name == k and info.shape == arrays[k].shape
        with pytest.raises(tf.NotFoundError, match="'absent'"):
            r.info("absent")
    loaded = tf.load_file(path)
    assert list(loaded) == keys
    for k, v in arrays.items():
        assert_same(loaded[k], v)
    # Views of one buffer, but never of each other's bytes.
    a, b = loaded["layer.0.é0"], loaded["layer.0.é6"]
    before = b.copy()
    a[...] = 0
    assert_same(b, before)


def test_fp4_packing_order(path):
    # Element 2i in the low nibble of byte i (DLPack's and TransformerEngine's order).
    codes = np.array([1, 2, 3, 4, 5], np.uint8)
    tf.save_file({"q": codes.view(ml_dtypes.float4_e2m1fn)}, path)
    with tf.Reader(path) as r:
        buf = np.empty(3, np.uint8)
        r.read_into("q", buf.ctypes.data, 3)
    assert list(buf) == [0x21, 0x43, 0x05]


def test_metadata_and_keys(path):
    tf.save_file({"b": np.zeros(2), "a": np.ones(3)}, path,
                 metadata={"step": "7", "config": '{"lr": 0.1}', "unicode": "αβγ"},
                 producer="pytest")
    with tf.safe_open(path) as f:
        assert f.keys() == ["a", "b"]
        assert f.metadata() == {"step": "7", "config": '{"lr": 0.1}', "unicode": "αβγ"}
    assert tf.read_metadata(path)["step"] == "7"
    with tf.Reader(path) as r:
        assert r.producer == "pytest"
        assert r.path == path
    with pytest.raises(TypeError, match="metadata"):
        tf.save_file({"a": np.ones(1)}, path, metadata={"step": 7})


def _mapped_from(arr, path):
    """True when arr's memory lies in a mapping of the file `path` (a zero-copy view)."""
    addr = arr.__array_interface__["data"][0]
    real = os.path.realpath(path)
    for line in open("/proc/self/maps"):
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= addr < hi:
            return len(fields) >= 6 and fields[5] == real
    return False


def test_zero_copy_views_are_private_copy_on_write(path):
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    bf = np.arange(100).astype(ml_dtypes.bfloat16)
    tf.save_file({"w": w, "bf": bf}, path)
    before = open(path, "rb").read()
    f = tf.safe_open(path)
    v = f.get_tensor("w")
    b = f.get_tensor("bf")
    assert_same(v, w)
    assert_same(b, bf)
    # Zero-copy: the arrays are mappings of the file, not copies.
    assert _mapped_from(v, path) and _mapped_from(b, path)
    rows = f.get_slice("w")[8:16]
    assert _mapped_from(rows, path)
    # Writable, as safetensors' arrays are; a write changes that array only: not the file, not
    # another view, not a later one.
    assert v.flags.writeable and b.flags.writeable
    v2 = f.get_tensor("w")
    v[0, 0] = -1
    b[:] = 7
    assert v2[0, 0] == 0 and f.get_tensor("w")[0, 0] == 0
    assert_same(f.get_tensor("bf"), bf)
    assert open(path, "rb").read() == before
    assert tf.load_file(path)["w"][0, 0] == 0
    # Views keep the mapping alive after the checkpoint is closed.
    f.close()
    del f, v2
    assert float(v.sum()) == float(w.sum()) - 1
    assert_same(rows, w[8:16])


def test_compressed_tensors_come_as_copies(path):
    w = np.zeros((128, 64), np.float32)
    tf.save_file({"w": w}, path, encoding="zstd", zstd_level=1)
    with tf.safe_open(path) as f:
        assert f.info("w").encoding == "zstd"
        assert f.info("w").data_size < w.nbytes
        v = f.get_tensor("w")
        assert_same(v, w)
        assert v.flags.writeable  # a copy: the caller's
        assert_same(f.get_slice("w")[3:5], w[3:5])


def test_get_slice_rows(path):
    w = np.arange(10 * 4, dtype=np.int32).reshape(10, 4)
    f8 = sample(ml_dtypes.float8_e5m2, (10, 4))
    tf.save_file({"w": w, "z": w, "f8": f8, "s": np.float32(1)}, path, encoding="raw")
    tf.save_file({"w": w}, path + ".z", encoding="shuffle_zstd")
    for p in (path, path + ".z"):
        with tf.safe_open(p) as f:
            s = f.get_slice("w")
            assert s.get_shape() == [10, 4]
            assert s.get_dtype() == "I32"
            assert_same(s[2:5], w[2:5])
            assert_same(s[-3:], w[-3:])
            assert_same(s[7], w[7])
            assert_same(s[-1], w[-1])
            assert_same(s[1:9:3], w[1:9:3])
            assert_same(s[2:4, 1:3], w[2:4, 1:3])
            assert s[5:5].shape == (0, 4)
            with pytest.raises(IndexError):
                s[10]
    with tf.safe_open(path) as f:
        assert_same(f.get_slice("f8")[4:6], f8[4:6])
        with pytest.raises(IndexError):
            f.get_slice("s")[0]


def test_dlpack_export(path):
    w = np.arange(12, dtype=np.float64).reshape(3, 4)
    tf.save_file({"w": w}, path)
    with tf.Reader(path) as r:
        t = r.view("w")
        assert t.__dlpack_device__() == (1, 0)
        # Views are private copy-on-write mappings: writable for every consumer, legacy too.
        assert t.shape == (3, 4) and not t.readonly
        assert t.dl_dtype == (2, 64, 1)
        legacy = t.__dlpack__()
        assert '"dltensor"' in repr(legacy)
        del legacy  # unconsumed legacy capsule: freed by its destructor
        t = r.view("w")
        cap = t.__dlpack__(max_version=(1, 0))
        assert "dltensor_versioned" in repr(cap)
        with pytest.raises(BufferError, match="already exported"):
            t.__dlpack__(max_version=(1, 0))
        del cap  # unconsumed capsule: its destructor frees the tensor

        loader = tf.Loader(threads=2)
        host = loader.load_to_host(r)
        assert not host["w"].readonly
        a = np.from_dlpack(host["w"])
        assert_same(a, w)
        assert a.flags.writeable
        a[0, 0] = 42  # loader memory is the caller's to write
        # Legacy capsule for old consumers of writable tensors.
        again = loader.load_to_host(r, ["w"])["w"]
        legacy = again.__dlpack__()
        assert '"dltensor"' in repr(legacy)
        del legacy
        loader.close()


def test_scaling_state_round_trip(path):
    class DelayedScaling:  # shaped like TransformerEngine's recipe object
        margin = 1
        fp8_format = type("Format", (), {"name": "E4M3"})()
        amax_history_len = 16
        amax_compute_algo = "most_recent"
        reduce_amax = False
        fp8_dpa = False
        fp8_mha = True

    hist = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    state = {
        "layers.0.fc1": {
            "recipe": DelayedScaling(),
            "states": [
                {"direction": "forward", "num_gemms": 1,
                 "slot_roles": ["input", "weight", "output"],
                 "scale": np.array([1, 0.5, 0.25], np.float32), "amax_history": hist},
                {"direction": "backward", "num_gemms": 1,
                 "slot_roles": ["grad_output", "grad_input"],
                 "scale": [2.0, 4.0], "amax_history": np.ones((16, 2))},
            ],
        },
        "layers.1.fc2": {"recipe": {"type": "MXFP8BlockScaling"}, "states": []},
        "layers.2": {"recipe": {"type": "CustomRecipe", "name": "my.recipe",
                                "qfactory": "my.factory"}, "states": []},
        "layers.3": {"recipe": {"type": "NVFP4BlockScaling", "disable_rht": True},
                     "states": []},
        "layers.4": {"recipe": None, "states": []},
    }
    tf.save_file({"w": np.zeros(1)}, path, scaling_state=state)
    got = tf.read_scaling_state(path)
    assert sorted(got) == sorted(state)
    fc1 = got["layers.0.fc1"]
    assert fc1["recipe"] == {"type": "DelayedScaling", "fp8_format": "E4M3", "margin": 1,
                             "amax_history_len": 16, "amax_compute_algo": "most_recent",
                             "reduce_amax": False, "fp8_dpa": False, "fp8_mha": True}
    fwd, bwd = fc1["states"]
    assert fwd["direction"] == "forward" and bwd["direction"] == "backward"
    assert fwd["slot_roles"] == ["input", "weight", "output"]
    assert np.array_equal(fwd["scale"], [1, 0.5, 0.25])
    assert fwd["amax_history"].shape == (16, 3) and np.array_equal(fwd["amax_history"], hist)
    assert bwd["amax_history"].dtype == np.float32 and bwd["amax_history"].shape == (16, 2)
    assert got["layers.1.fc2"] == {"recipe": {"type": "MXFP8BlockScaling",
                                              "fp8_format": "E4M3"}, "states": []}
    assert got["layers.2"]["recipe"]["name"] == "my.recipe"
    assert got["layers.2"]["recipe"]["qfactory"] == "my.factory"
    assert got["layers.3"]["recipe"]["disable_rht"] is True
    assert got["layers.4"]["recipe"] is None


def test_scaling_state_rejects_bad_input(path):
    with pytest.raises(ValueError, match="fp8_format"):
        tf.save_file({}, path, scaling_state={
            "m": {"recipe": {"type": "DelayedScaling", "fp8_format": "E9M9"}, "states": []}})
    # The library's check, naming the file and the module.
    with pytest.raises(ValueError, match="scaling state 'm': a custom recipe needs custom_name"):
        tf.save_file({}, path, scaling_state={"m": {"recipe": {"type": "CustomRecipe"},
                                                    "states": []}})
    with pytest.raises(ValueError, match="disagree"):
        tf.save_file({}, path, scaling_state={"m": {"recipe": None, "states": [
            {"slot_roles": ["input"], "scale": [1, 2], "amax_history": np.zeros((2, 2))}]}})

    class Callable:
        amax_compute_algo = staticmethod(lambda h: h.max())

    Callable.__name__ = "DelayedScaling"
    with pytest.raises(TypeError, match="callable"):
        tf.save_file({}, path, scaling_state={"m": {"recipe": Callable(), "states": []}})
    assert not os.path.exists(path)


def test_errors_carry_the_message(path, tmp_path):
    missing = str(tmp_path / "missing.ferry")
    with pytest.raises(tf.NotFoundError, match="missing.ferry"):
        tf.load_file(missing)

    bad = tmp_path / "bad.ferry"
    bad.write_bytes(b"TFERRY01" + b"\0" * 100)
    with pytest.raises(tf.DataLossError, match="bad.ferry") as e:
        tf.safe_open(str(bad))
    assert e.value.status == "DataLoss" and e.value.code == 3

    tf.save_file({"w": np.zeros(4096, np.uint8)}, path)
    data = bytearray(open(path, "rb").read())
    data[-30] ^= 0xFF
    (tmp_path / "flipped.ferry").write_bytes(bytes(data))
    with pytest.raises(tf.DataLossError, match="offset"):
        tf.load_file(str(tmp_path / "flipped.ferry"))

    with tf.safe_open(path) as f:
        with pytest.raises(tf.NotFoundError, match="'nope'") as e:
            f.get_tensor("nope")
        assert path in str(e.value)
        with pytest.raises(LookupError):
            f.get_slice("nope")

    # A checksum mismatch in tensor data is found on verify.
    data = bytearray(open(path, "rb").read())
    with tf.Reader(path) as r:
        off = r.info("w").data_offset
    data[off + 100] ^= 0x01
    (tmp_path / "rot.ferry").write_bytes(bytes(data))
    with pytest.raises(tf.DataLossError, match="'w'"):
        tf.load_file(str(tmp_path / "rot.ferry"), verify=True)
    with tf.safe_open(str(tmp_path / "rot.ferry"), verify=True) as f:
        with pytest.raises(tf.DataLossError, match="checksum"):
            f.get_tensor("w")

    with pytest.raises(TypeError, match="no checkpoint dtype"):
        tf.save_file({"o": np.array(["text"])}, path)
    with pytest.raises(ValueError, match="encoding"):
        tf.save_file({}, path, encoding="lz4")
    with pytest.raises(ValueError, match="host"):
        tf.load_file(path, device="cuda", framework="np")


def test_failed_save_leaves_old_file(path):
    tf.save_file({"old": np.ones(3)}, path)
    with pytest.raises(TypeError):
        tf.save_file({"new": np.ones(3), "bad": object()}, path)
    assert list(tf.load_file(path)) == ["old"]
    assert [p for p in os.listdir(os.path.dirname(path)) if ".tmp" in p] == []


def test_library_and_version():
    assert tf.version().count(".") == 2
    assert os.path.exists(tf.library_path())
    assert isinstance(tf.cuda_available(), bool)


def test_loads_verify_by_default(path):
    w = np.arange(4096 * 3, dtype=np.float32).reshape(3, 4096)
    tf.save_file({"w": w, "other": np.ones(7, np.int16)}, path)
    flip_data_byte(path, "w", 4 * 4096 + 17)
    with pytest.raises(tf.DataLossError, match=r"tensor 'w': checksum mismatch in block 0"):
        tf.load_file(path)
    with pytest.raises(tf.DataLossError, match=r"tensor 'w'"):
        tf.numpy.load_file(path)
    with pytest.raises(tf.DataLossError, match=r"tensor 'w'"):
        tf.Loader().load_to_host(tf.Reader(path))
    with tf.safe_open(path, "np") as f:
        assert_same(f.get_tensor("other"), np.ones(7, np.int16))
        with pytest.raises(tf.DataLossError, match=r"tensor 'w'"):
            f.get_tensor("w")
        with pytest.raises(tf.DataLossError, match=r"tensor 'w'"):
            f.get_slice("w")[0:1]
    # Opting out returns the bytes as stored.
    got = tf.load_file(path, verify=False)["w"]
    assert not np.array_equal(got, w)
    assert np.array_equal(got.reshape(-1)[:4096], w.reshape(-1)[:4096])
    with tf.safe_open(path, "np", verify=False) as f:
        assert not np.array_equal(f.get_tensor("w"), w)


def test_many_tensor_load_is_exact(path):
    # Enough tensors that the views are built while the load runs (beside the library call).
    arrays = {"t.%04d" % i: sample(np.float32, (i % 5 + 1, 3), seed=i) for i in range(600)}
    arrays["bf"] = sample(ml_dtypes.bfloat16, (33, 7))
    arrays["fp4"] = sample(ml_dtypes.float4_e2m1fn, (3, 5))
    tf.save_file(arrays, path)
    got = tf.load_file(path)
    assert got.keys() == arrays.keys()
    for k, v in arrays.items():
        assert_same(got[k], v)
    flip_data_byte(path, "t.0599", 3)
    with pytest.raises(tf.DataLossError, match=r"tensor 't.0599'"):
        tf.load_file(path)
