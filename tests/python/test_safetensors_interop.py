"""safetensors files written by the reference `safetensors` package, read through TensorFerry's
C++ reader (the `ferry` command, and the tensorferry package over the C API), and converted
both ways without changing a byte.

Needs: pip install safetensors numpy ml_dtypes. The `ferry` binary is found through FERRY_BIN,
FERRY_BUILD_DIR (tests/run_all.sh sets it) or the checkout's build*/src/cli directories.
"""
import glob
import json
import os
import struct
import subprocess

import numpy as np
import pytest

safetensors = pytest.importorskip("safetensors")
ml_dtypes = pytest.importorskip("ml_dtypes")
from safetensors import TensorSpec, serialize_file  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _find_ferry():
    if os.environ.get("FERRY_BIN"):
        return os.environ["FERRY_BIN"]
    candidates = []
    if os.environ.get("FERRY_BUILD_DIR"):
        candidates.append(os.path.join(os.environ["FERRY_BUILD_DIR"], "src", "cli", "ferry"))
    candidates += sorted(glob.glob(os.path.join(ROOT, "build*", "src", "cli", "ferry")),
                         key=os.path.getmtime, reverse=True)
    for c in candidates:
        if os.access(c, os.X_OK):
            return c
    return None


FERRY = _find_ferry()
needs_ferry = pytest.mark.skipif(FERRY is None, reason="no built `ferry` (set FERRY_BIN)")


def ferry(*args, expect=0):
    p = subprocess.run([FERRY, *map(str, args)], capture_output=True, text=True)
    assert p.returncode == expect, "ferry %s: exit %d\n%s%s" % (
        " ".join(map(str, args)), p.returncode, p.stdout, p.stderr)
    return p


def _tensorferry():
    try:
        import tensorferry

        tensorferry.load_library()
        return tensorferry
    except Exception as e:  # package absent or library not built
        pytest.skip("tensorferry package unavailable: %s" % e)


def raw_tensors(path):
    """{name: (dtype, shape, bytes)} as the reference library reads the file."""
    with open(path, "rb") as f:
        return {n: (v["dtype"], list(v["shape"]), bytes(v["data"]))
                for n, v in safetensors.deserialize(f.read())}


def numpy_arrays(path, arrays):
    """The tensors of `arrays` whose dtype the reference library's numpy backend supports
    (it has no FP8 or bfloat16), as it loads them from `path`."""
    out = {}
    with safetensors.safe_open(str(path), framework="numpy") as f:
        for name, a in arrays.items():
            if a.dtype.type.__module__ == "numpy":
                out[name] = f.get_tensor(name)
    assert len(out) > len(arrays) // 2
    return out


def sample_arrays(seed=0):
    rng = np.random.default_rng(seed)
    normal = rng.standard_normal
    return {
        "model.embed_tokens.weight": normal((64, 48)).astype(ml_dtypes.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": normal((48, 48)).astype(np.float16),
        "model.layers.0.mlp.up_proj.weight": normal((96, 48)).astype(np.float32),
        "model.layers.0.mlp.fp8": normal((32, 16)).astype(ml_dtypes.float8_e4m3fn),
        "model.layers.0.mlp.fp8_e5m2": normal((8, 8)).astype(ml_dtypes.float8_e5m2),
        "model.norm.weight": np.ones(48, dtype=np.float64),
        "position_ids": np.arange(17, dtype=np.int64),
        "mask": rng.integers(0, 2, 11).astype(bool),
        "tokens.u8": rng.integers(0, 255, 9).astype(np.uint8),
        "tokens.i8": rng.integers(-100, 100, 5).astype(np.int8),
        "tokens.i16": rng.integers(-1000, 1000, 6).astype(np.int16),
        "tokens.u16": rng.integers(0, 60000, 6).astype(np.uint16),
        "tokens.i32": rng.integers(-10**6, 10**6, 6).astype(np.int32),
        "tokens.u32": rng.integers(0, 10**9, 6).astype(np.uint32),
        "tokens.u64": rng.integers(0, 10**12, 3).astype(np.uint64),
        "complex": (normal(4) + 1j * normal(4)).astype(np.complex64),
        "scalar": np.array(2.5, dtype=np.float32),
        "empty": np.zeros((0, 7), dtype=np.float32),
    }


@pytest.fixture
def reference_file(tmp_path):
    arrays = sample_arrays()
    path = tmp_path / "model.safetensors"
    save_file(arrays, str(path), metadata={"format": "pt", "step": "42"})
    return path, arrays


# ---- the Python package reads safetensors through the C++ reader ------------------------------


def test_python_package_loads_reference_file_bit_exactly(reference_file):
    tf = _tensorferry()
    path, arrays = reference_file
    loaded = tf.load_file(str(path))
    assert sorted(loaded) == sorted(arrays)
    for name, want in arrays.items():
        got = loaded[name]
        assert got.dtype == want.dtype, name
        assert got.shape == want.shape, name
        assert got.tobytes() == want.tobytes(), name
    assert tf.read_metadata(str(path)) == {"format": "pt", "step": "42"}
    with tf.safe_open(str(path), framework="np") as f:
        view = f.get_tensor("model.layers.0.mlp.up_proj.weight")
        np.testing.assert_array_equal(view, arrays["model.layers.0.mlp.up_proj.weight"])
        before = path.read_bytes()
        view[:] = 0  # a private copy-on-write view: the .safetensors file stays as it was
        assert path.read_bytes() == before
        assert f.get_tensor("model.layers.0.mlp.up_proj.weight").tobytes() == \
            arrays["model.layers.0.mlp.up_proj.weight"].tobytes()
        rows = f.get_slice("model.embed_tokens.weight")[3:9]
        assert rows.tobytes() == arrays["model.embed_tokens.weight"][3:9].tobytes()


def test_python_package_reports_malformed_header(tmp_path):
    tf = _tensorferry()
    path = tmp_path / "bad.safetensors"
    header = b'{"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}'
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    with pytest.raises(tf.DataLossError) as e:
        tf.load_file(str(path))
    assert "tensor 't'" in str(e.value) and "needs 12" in str(e.value)


# ---- the ferry command ---------------------------------------------------------------------------


@needs_ferry
def test_inspect_json_matches_the_reference_header(reference_file):
    path, arrays = reference_file
    info = json.loads(ferry("inspect", "--json", path).stdout)
    assert info["format"] == "safetensors"
    assert info["checksums"] is None
    assert info["metadata"] == {"format": "pt", "step": "42"}
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    by_name = {t["name"]: t for t in info["tensors"]}
    assert sorted(by_name) == sorted(arrays)
    names = {"F8_E4M3": "F8_E4M3FN"}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        t = by_name[name]
        assert t["dtype"] == names.get(entry["dtype"], entry["dtype"])
        assert t["shape"] == entry["shape"]
        begin, end = entry["data_offsets"]
        assert t["data_offset"] == 8 + n + begin
        assert t["raw_bytes"] == end - begin == arrays[name].nbytes


@needs_ferry
def test_safetensors_to_ferry_to_safetensors_keeps_every_byte(reference_file, tmp_path):
    path, arrays = reference_file
    for encoding in ("raw", "zstd", "shuffle+zstd"):
        mid = tmp_path / ("mid-%s.ferry" % encoding.replace("+", "_"))
        back = tmp_path / ("back-%s.safetensors" % encoding.replace("+", "_"))
        ferry("convert", path, mid, "--encoding", encoding, "--block-size", "4KiB")
        assert "OK" in ferry("verify", mid).stdout
        ferry("convert", mid, back)
        assert raw_tensors(back) == raw_tensors(path)
        # The reference library reads our file and gets the same arrays.
        for name, got in numpy_arrays(back, arrays).items():
            assert got.tobytes() == arrays[name].tobytes(), name
        # Same layout as the reference writer: identical data sections.
        with open(path, "rb") as a, open(back, "rb") as b:
            na = struct.unpack("<Q", a.read(8))[0]
            nb = struct.unpack("<Q", b.read(8))[0]
            a.seek(8 + na)
            b.seek(8 + nb)
            assert a.read() == b.read()


@needs_ferry
def test_ferry_to_safetensors_to_ferry_keeps_every_byte(reference_file, tmp_path):
    path, _ = reference_file
    first, second = tmp_path / "first.ferry", tmp_path / "second.ferry"
    ferry("convert", path, first)
    ferry("convert", first, tmp_path / "via.safetensors")
    ferry("convert", tmp_path / "via.safetensors", second)
    assert first.read_bytes() == second.read_bytes()


@needs_ferry
def test_file_written_by_tensorferry_converts_to_safetensors(tmp_path):
    tf = _tensorferry()
    arrays = sample_arrays(seed=3)
    src = tmp_path / "tf.ferry"
    tf.save_file(arrays, str(src), metadata={"producer": "pytest"}, encoding="shuffle_zstd")
    out = tmp_path / "tf.safetensors"
    ferry("convert", src, out)
    assert sorted(raw_tensors(out)) == sorted(arrays)
    for name, got in numpy_arrays(out, arrays).items():
        assert got.dtype == arrays[name].dtype, name
        assert got.tobytes() == arrays[name].tobytes(), name
    with safetensors.safe_open(str(out), framework="numpy") as f:
        assert f.metadata() == {"producer": "pytest"}


@needs_ferry
def test_narrow_float_dtypes_and_large_tensor(tmp_path):
    rng = np.random.default_rng(5)
    keep = []

    def spec(dtype, shape, nbytes):
        buf = rng.integers(0, 256, nbytes, dtype=np.uint8)
        keep.append(buf)
        return TensorSpec(dtype=dtype, shape=shape, data_ptr=buf.ctypes.data, data_len=nbytes)

    specs = {
        "fp4": spec("float4_e2m1fn_x2", (4, 3), 12),  # storage shape: 4 x 6 F4 values
        "e8m0": spec("float8_e8m0fnu", (16,), 16),
        "e4m3fnuz": spec("float8_e4m3fnuz", (5,), 5),
        "e5m2fnuz": spec("float8_e5m2fnuz", (5,), 5),
        # Larger than the converter's 16 MiB pieces.
        "big": spec("bfloat16", (5000, 2000), 20_000_000),
    }
    path = tmp_path / "narrow.safetensors"
    serialize_file(specs, str(path))
    info = json.loads(ferry("inspect", "--json", path).stdout)
    dtypes = {t["name"]: (t["dtype"], t["shape"]) for t in info["tensors"]}
    assert dtypes["fp4"] == ("F4_E2M1FN", [4, 6])
    assert dtypes["e8m0"] == ("F8_E8M0FNU", [16])
    assert dtypes["e4m3fnuz"] == ("F8_E4M3FNUZ", [5])
    ferry("convert", path, tmp_path / "narrow.ferry", "--encoding", "zstd")
    ferry("convert", tmp_path / "narrow.ferry", tmp_path / "back.safetensors")
    assert raw_tensors(tmp_path / "back.safetensors") == raw_tensors(path)


@needs_ferry
def test_sharded_checkpoint_becomes_one_file(tmp_path):
    shards = {}
    weight_map = {}
    expected = {}
    for k in range(3):
        arrays = {"layers.%d.w" % k: np.full((4, 5), k, np.float32),
                  "layers.%d.b" % k: np.arange(5, dtype=np.float16) + k}
        name = "model-%05d-of-00003.safetensors" % (k + 1)
        save_file(arrays, str(tmp_path / name), metadata={"format": "pt"})
        shards[name] = arrays
        weight_map.update({n: name for n in arrays})
        expected.update(arrays)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 123}, "weight_map": weight_map}))
    out = tmp_path / "merged.ferry"
    p = ferry("convert", index, out)
    assert "3 shards" in p.stdout and "6 tensors" in p.stdout
    ferry("convert", out, tmp_path / "merged.safetensors")
    loaded = safetensors.numpy.load_file(str(tmp_path / "merged.safetensors"))
    assert sorted(loaded) == sorted(expected)
    for name, want in expected.items():
        assert loaded[name].tobytes() == want.tobytes(), name

    # An index that puts a tensor in the wrong shard is refused, naming the tensor.
    weight_map["layers.2.w"] = "model-00001-of-00003.safetensors"
    index.write_text(json.dumps({"weight_map": weight_map}))
    p = ferry("convert", index, tmp_path / "bad.ferry", expect=1)
    assert "tensor 'layers.2.w'" in p.stderr and "does not hold it" in p.stderr
    assert not (tmp_path / "bad.ferry").exists()


def _image(header, data=b"", length=None):
    header = header.encode() if isinstance(header, str) else header
    return struct.pack("<Q", len(header) if length is None else length) + header + data


MALFORMED = [
    ("huge-length", _image("{", length=1 << 40),
     ["safetensors header length 1099511627776", "exceeds the limit of 104857600"]),
    ("invalid-json", _image('{"t": {"dtype": "F32",,}}'), ["invalid JSON at file offset 30"]),
    ("out-of-range", _image('{"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', b"1234"),
     ["tensor 't': data_offsets [0, 8]", "run past the end of the 4-byte data section"]),
    ("overlap", _image('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                       '"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', b"12345678"),
     ["tensor 'b': data_offsets [4, 8] overlap tensor 'a' at [0, 8]"]),
    ("unknown-dtype", _image('{"t":{"dtype":"F5","shape":[2],"data_offsets":[0,2]}}', b"12"),
     ["tensor 't': unknown dtype 'F5'"]),
    ("size-mismatch", _image('{"t":{"dtype":"BF16","shape":[3],"data_offsets":[0,8]}}',
                             b"12345678"),
     ["tensor 't'", "hold 8 bytes but shape [3] of BF16 needs 6"]),
]


@needs_ferry
@pytest.mark.parametrize("case,image,messages", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_headers_get_clear_errors(tmp_path, case, image, messages):
    path = tmp_path / ("%s.safetensors" % case)
    path.write_bytes(image)
    for command in (["inspect"], ["verify"], ["convert", "--encoding", "zstd"]):
        args = [command[0], path] + ([tmp_path / "out.ferry"] + command[1:] if
                                     command[0] == "convert" else [])
        p = ferry(*args, expect=1)
        assert "DataLoss" in p.stderr and str(path) in p.stderr
        for m in messages:
            assert m in p.stderr, p.stderr
    # The reference library refuses these files too.
    with pytest.raises(Exception):
        safetensors.numpy.load_file(str(path))


def _same_state(a, b):
    assert sorted(a) == sorted(b)
    for module in a:
        assert a[module]["recipe"] == b[module]["recipe"], module
        assert len(a[module]["states"]) == len(b[module]["states"]), module
        for x, y in zip(a[module]["states"], b[module]["states"]):
            for key in x:
                if isinstance(x[key], np.ndarray):
                    np.testing.assert_array_equal(x[key], y[key])  # NaN equals NaN here
                    assert x[key].tobytes() == y[key].tobytes(), (module, key)
                else:
                    assert x[key] == y[key], (module, key)


@needs_ferry
def test_fp8_scaling_state_survives_a_trip_through_safetensors(tmp_path):
    tf = _tensorferry()
    state = {
        "layers.0.mlp.fc1": {
            "recipe": {"type": "DelayedScaling", "margin": 1, "fp8_format": "HYBRID",
                       "amax_history_len": 3, "amax_compute_algo": "most_recent",
                       "reduce_amax": False, "fp8_dpa": True, "fp8_mha": False},
            "states": [
                {"direction": "forward", "num_gemms": 1,
                 "slot_roles": ["input", "weight", "output"],
                 "scale": np.array([1.0, 0.1, np.inf], np.float32),
                 "amax_history": np.array([[0.5, np.nan, 3.0], [1e-38, -0.0, 2.0],
                                           [7.0, 8.0, 9.0]], np.float32)},
                {"direction": "backward", "num_gemms": 1,
                 "slot_roles": ["grad_output", "grad_input"],
                 "scale": np.array([0.25, 4.0], np.float32),
                 "amax_history": np.zeros((3, 2), np.float32)},
            ],
        },
        "layers.1.mlp.fc1": {"recipe": {"type": "MXFP8BlockScaling", "fp8_format": "E4M3"},
                             "states": []},
    }
    src = tmp_path / "fp8.ferry"
    tf.save_file({"w": np.arange(8, dtype=np.float32)}, str(src), scaling_state=state)
    via = tmp_path / "fp8.safetensors"
    ferry("convert", src, via)
    with safetensors.safe_open(str(via), framework="numpy") as f:
        assert "tensorferry.scaling" in f.metadata()
        assert f.get_tensor("w").tolist() == list(range(8))
    back = tmp_path / "back.ferry"
    ferry("convert", via, back)
    _same_state(tf.read_scaling_state(str(src)), tf.read_scaling_state(str(back)))
    assert tf.read_metadata(str(back)) == {}
    assert src.read_bytes() == back.read_bytes()
