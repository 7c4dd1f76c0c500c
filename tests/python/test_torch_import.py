"""PyTorch checkpoints into TensorFerry without running their pickles.

The checkpoints are built by torch_like.py (torch's exact archive and pickle layout, made
without torch); tests/data/torch/ holds ones made by the real torch (make_fixtures.py) and
test_real_torch_fixtures checks those when present.
"""

import collections
import ctypes
import io
import json
import os
import pickle
import re
import struct
import subprocess
import sys
import zipfile

import numpy as np
import pytest

import torch_like as tl
from test_safetensors_interop import FERRY, ferry, needs_ferry, _tensorferry

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# FERRY_TORCH_FIXTURES: a folder written by make_fixtures.py elsewhere (the device script).
FIXTURES = os.environ.get("FERRY_TORCH_FIXTURES") or os.path.join(ROOT, "tests", "data", "torch")


def ferry_bytes(path):
    """{name: (dtype, shape, bytes)} of a TensorFerry file, read through the C API."""
    tf = _tensorferry()
    out = {}
    with tf.Reader(str(path)) as r:
        for n in r.keys():
            info = r.info(n)
            shape, nbytes = r.region(n)
            buf = (ctypes.c_uint8 * max(1, nbytes))()
            r.read_into(n, ctypes.addressof(buf), nbytes, verify=True)
            out[n] = (info.dtype, list(shape), bytes(buf)[:nbytes])
    return out


def dense(t):
    """The row-major bytes a Tensor stand-in describes, computed by numpy from its storage."""
    item = tl.DTYPES[t.storage.dtype][2]
    raw = np.frombuffer(t.storage.data, dtype="V%d" % item)
    view = np.lib.stride_tricks.as_strided(
        raw[t.offset:], shape=t.shape, strides=[s * item for s in t.stride])
    return np.ascontiguousarray(view).tobytes()


FERRY_DTYPES = {"float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16",
                "int8": "I8", "int16": "I16", "int32": "I32", "int64": "I64", "uint8": "U8",
                "bool": "BOOL", "complex64": "C64", "complex128": "C128", "uint16": "U16",
                "uint32": "U32", "uint64": "U64", "float8_e4m3fn": "F8_E4M3FN",
                "float8_e5m2": "F8_E5M2", "float8_e4m3fnuz": "F8_E4M3FNUZ",
                "float8_e5m2fnuz": "F8_E5M2FNUZ", "float8_e8m0fnu": "F8_E8M0FNU",
                "float4_e2m1fn_x2": "F4_E2M1FN"}


def sample_state_dict(seed=0):
    """Every dtype, views with storage offsets and strides, shared and overlapping storages,
    a nested dict, plain values. Returns (object to save, {name: expected (dtype, shape,
    bytes)})."""
    rng = np.random.default_rng(seed)
    sd = collections.OrderedDict()
    expect = {}
    for i, (name, (np_dtype, _, item)) in enumerate(sorted(tl.DTYPES.items())):
        if name not in FERRY_DTYPES:
            continue
        data = rng.integers(0, 256, size=6 * item, dtype=np.uint8).tobytes()
        if name == "bool":
            data = bytes(b & 1 for b in data)
        t = tl.Tensor(tl.Storage(data, name), (2, 3))
        sd["dtypes." + name] = t
        shape = [2, 6] if name == "float4_e2m1fn_x2" else [2, 3]
        expect["model.dtypes." + name] = (FERRY_DTYPES[name], shape, dense(t))
    base = tl.Storage(np.arange(60, dtype=np.float32).tobytes(), "float32")
    views = {
        "full": tl.Tensor(base, (6, 10)),
        "rows": tl.Tensor(base, (2, 10), offset=20),          # storage offset
        "transposed": tl.Tensor(base, (10, 6), stride=(1, 10)),  # non-contiguous
        "every_other": tl.Tensor(base, (3, 5), stride=(20, 2), offset=1),
        "broadcast": tl.Tensor(base, (4, 3), stride=(0, 1), offset=7),  # overlapping
        "scalar": tl.Tensor(base, (), offset=59),
        "empty": tl.Tensor(base, (0, 4)),
    }
    for k, t in views.items():
        sd["views." + k] = t
        expect["model.views." + k] = ("F32", list(t.shape), dense(t))
    obj = {"model": sd, "epoch": 7, "lr": 0.5, "name": "run-1",
           "nested": {"deeper": {"t": tl.tensor(np.arange(4, dtype=np.int16))}}}
    expect["nested.deeper.t"] = ("I16", [4], np.arange(4, dtype=np.int16).tobytes())
    return obj, expect


@needs_ferry
@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_every_dtype_and_view_converts_bit_exactly(tmp_path, protocol):
    obj, expect = sample_state_dict()
    tl.torch_save(obj, tmp_path / "model.pt", protocol=protocol)
    ferry("convert", tmp_path / "model.pt", tmp_path / "model.ferry")
    got = ferry_bytes(tmp_path / "model.ferry")
    assert got == expect
    tf = _tensorferry()
    md = tf.read_metadata(str(tmp_path / "model.ferry"))
    assert md["epoch"] == "7" and md["lr"] == "0.5" and md["name"] == "run-1"


@needs_ferry
def test_python_convert_matches_the_command(tmp_path):
    tf = _tensorferry()
    obj, expect = sample_state_dict(1)
    tl.torch_save(obj, tmp_path / "pytorch_model.bin")
    tf.convert(tmp_path / "pytorch_model.bin", tmp_path / "py.ferry", encoding="shuffle_zstd")
    assert ferry_bytes(tmp_path / "py.ferry") == expect


def test_python_convert_never_uses_pickle(tmp_path):
    """The conversion path imports neither pickle nor torch: run it with both unimportable."""
    _tensorferry()
    obj, expect = sample_state_dict(2)
    tl.torch_save(obj, tmp_path / "m.pt")
    code = (
        "import sys\n"
        "for m in ('pickle', '_pickle', 'torch', 'copyreg'):\n"
        "    sys.modules[m] = None\n"
        "import tensorferry\n"
        "tensorferry.convert(sys.argv[1], sys.argv[2])\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.join(ROOT, "bindings", "python")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m.pt"),
                        str(tmp_path / "m.ferry")], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    assert ferry_bytes(tmp_path / "m.ferry") == expect


@needs_ferry
def test_to_safetensors_where_dtypes_allow(tmp_path):
    safetensors = pytest.importorskip("safetensors")
    obj, expect = sample_state_dict(3)
    tl.torch_save(obj, tmp_path / "m.pt")
    p = ferry("convert", tmp_path / "m.pt", tmp_path / "m.safetensors", expect=1)
    assert "C128, which safetensors cannot represent" in p.stderr
    del obj["model"]["dtypes.complex128"]
    del expect["model.dtypes.complex128"]
    tl.torch_save(obj, tmp_path / "m.pt")
    ferry("convert", tmp_path / "m.pt", tmp_path / "m.safetensors")
    with open(tmp_path / "m.safetensors", "rb") as f:
        got = {n: bytes(v["data"]) for n, v in safetensors.deserialize(f.read())}
    assert got == {n: v[2] for n, v in expect.items()}


@needs_ferry
def test_inspect_lists_tensors_views_and_devices(tmp_path):
    a = np.arange(12, dtype=np.float32)
    st = tl.Storage(a.tobytes(), "float32", location="cuda:3")
    tl.torch_save({"w": tl.Tensor(st, (3, 4)), "wt": tl.Tensor(st, (4, 3), stride=(1, 4))},
                  tmp_path / "m.pt")
    p = ferry("inspect", tmp_path / "m.pt")
    assert "torch.save (read without running its pickles)" in p.stdout
    assert "wt  F32  [4, 3]  48 B  strided view (copied dense), saved from cuda:3" in p.stdout
    j = json.loads(ferry("inspect", "--json", tmp_path / "m.pt").stdout)
    assert [t["name"] for t in j["tensors"]] == ["w", "wt"]
    assert j["tensors"][1]["stride"] == [1, 4] and j["tensors"][1]["saved_location"] == "cuda:3"


@needs_ferry
@pytest.mark.parametrize("fixture", ["dtypes.pt", "te_cuda.pt"])
def test_inspect_separates_sections_with_blank_lines_not_escapes(fixture):
    # Every printed line is escaped as a whole, so a section's leading newline came out as a
    # literal \x0a: blank lines are lines of their own.
    out = ferry("inspect", os.path.join(FIXTURES, fixture)).stdout
    assert "\\x0a" not in out
    heads = [line for line in out.splitlines()
             if line.startswith(("metadata (", "TransformerEngine extra state ("))]
    assert heads, out
    lines = out.splitlines()
    for h in heads:
        assert lines[lines.index(h) - 1] == ""


@needs_ferry
def test_sharded_bin_index_becomes_one_file(tmp_path):
    w = {"a": np.arange(4, dtype=np.float32), "b": np.ones((2, 2), np.int32),
         "c": np.zeros(3, np.float64)}
    tl.torch_save({"a": tl.tensor(w["a"]), "b": tl.tensor(w["b"])},
                  tmp_path / "pytorch_model-00001-of-00002.bin")
    tl.torch_save({"c": tl.tensor(w["c"])}, tmp_path / "pytorch_model-00002-of-00002.bin")
    index = {"metadata": {"total_size": 48},
             "weight_map": {"a": "pytorch_model-00001-of-00002.bin",
                            "b": "pytorch_model-00001-of-00002.bin",
                            "c": "pytorch_model-00002-of-00002.bin"}}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    ferry("inspect", tmp_path / "pytorch_model.bin.index.json")
    ferry("convert", tmp_path / "pytorch_model.bin.index.json", tmp_path / "m.ferry")
    got = ferry_bytes(tmp_path / "m.ferry")
    assert {n: v[2] for n, v in got.items()} == {n: a.tobytes() for n, a in w.items()}
    index["weight_map"]["c"] = "pytorch_model-00001-of-00002.bin"
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    p = ferry("convert", tmp_path / "pytorch_model.bin.index.json", tmp_path / "x.ferry",
              expect=1)
    assert "weight_map puts tensor 'c' in shard" in p.stderr
    assert not (tmp_path / "x.ferry").exists()


@needs_ferry
def test_dcp_folder(tmp_path):
    w = {"layer.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
         "layer.bias": np.arange(3, dtype=np.int64)}
    tl.dcp_save({k: tl.tensor(v) for k, v in w.items()}, tmp_path / "ckpt")
    p = ferry("inspect", tmp_path / "ckpt")
    assert "PyTorch DCP" in p.stdout
    ferry("convert", tmp_path / "ckpt", tmp_path / "m.ferry")
    got = ferry_bytes(tmp_path / "m.ferry")
    assert {n: (v[1], v[2]) for n, v in got.items()} == {
        n: (list(a.shape), a.tobytes()) for n, a in w.items()}


@needs_ferry
def test_dcp_tensor_in_several_chunks(tmp_path):
    full = np.arange(40, dtype=np.float32).reshape(8, 5)
    top, bottom = tl.tensor(full[:3]), tl.tensor(full[3:])
    tl.dcp_save({"w": tl.tensor(full)}, tmp_path / "ckpt",
                chunks={"w": [((0, 0), top), ((3, 0), bottom)]})
    ferry("convert", tmp_path / "ckpt", tmp_path / "m.ferry")
    assert ferry_bytes(tmp_path / "m.ferry")["w"] == ("F32", [8, 5], full.tobytes())
    # Chunks that leave a hole are refused.
    tl.dcp_save({"w": tl.tensor(full)}, tmp_path / "hole",
                chunks={"w": [((0, 0), top), ((4, 0), tl.tensor(full[4:]))]})
    p = ferry("convert", tmp_path / "hole", tmp_path / "h.ferry", expect=1)
    assert "'w'" in p.stderr and "chunks" in p.stderr


# ---- TransformerEngine extra state -------------------------------------------------------------

RECIPES = [
    (lambda: tl.recipe.DelayedScaling(margin=2, fp8_format=tl.recipe.Format.E4M3,
                                      amax_history_len=4, amax_compute_algo="most_recent",
                                      reduce_amax=False, fp8_dpa=True),
     {"type": "DelayedScaling", "margin": 2, "fp8_format": "E4M3", "amax_history_len": 4,
      "amax_compute_algo": "most_recent", "reduce_amax": False, "fp8_dpa": True,
      "fp8_mha": False}),
    (lambda: tl.recipe.Float8CurrentScaling(fp8_format=tl.recipe.Format.E5M2, fp8_mha=True),
     {"type": "Float8CurrentScaling", "fp8_format": "E5M2", "fp8_dpa": False, "fp8_mha": True}),
    (lambda: tl.recipe.MXFP8BlockScaling(), {"type": "MXFP8BlockScaling", "fp8_format": "E4M3"}),
    (lambda: tl.recipe.Float8BlockScaling(x_block_scaling_dim=2),
     {"type": "Float8BlockScaling", "fp8_format": "E4M3", "x_block_scaling_dim": 2,
      "w_block_scaling_dim": 2, "grad_block_scaling_dim": 1}),
    (lambda: tl.recipe.NVFP4BlockScaling(disable_rht=True),
     {"type": "NVFP4BlockScaling", "disable_rht": True, "disable_stochastic_rounding": False,
      "disable_2d_quantization": False}),
]


def _extra_state_forms(recipe_obj, num_gemms, seed):
    """(form name, extra state value, arrays) for every TransformerEngine version."""
    out = []
    state, arrays = tl.te_state(recipe_obj, num_gemms=num_gemms, seed=seed, make=tl.plain_tensor)
    out.append(("uint8 pickle (2.x)", tl.uint8_tensor(tl.plain_pickle(state)), arrays))
    mk = lambda a: tl.plain_tensor(a, location="cuda:0")  # noqa: E731
    state, arrays = tl.te_state(recipe_obj, num_gemms=num_gemms, seed=seed + 1, make=mk)
    out.append(("uint8 pickle with CUDA tensors", tl.uint8_tensor(tl.plain_pickle(state)),
                arrays))
    state, arrays = tl.te_state(recipe_obj, num_gemms=num_gemms, seed=seed + 2,
                                make=lambda a: tl.tensor(a, location="cuda:0"))
    out.append(("io.BytesIO of torch.save (1.x)", io.BytesIO(tl.torch_save_bytes(state)), arrays))
    state, arrays = tl.te_state(recipe_obj, num_gemms=num_gemms, seed=seed + 3,
                                make=lambda a: tl.tensor(a, location="cuda:0"))
    out.append(("CUDA tensors in the state dict", state, arrays))
    return out


@needs_ferry
@pytest.mark.parametrize("recipe_index", range(len(RECIPES)))
def test_extra_state_of_every_version_becomes_scaling_state(tmp_path, recipe_index):
    tf = _tensorferry()
    make_recipe, recipe_dict = RECIPES[recipe_index]
    forms = _extra_state_forms(make_recipe(), num_gemms=2, seed=10 * recipe_index)
    sd = collections.OrderedDict()
    sd["fc.weight"] = tl.tensor(np.ones((2, 2), np.float32))
    for k, (_, value, _) in enumerate(forms):
        sd["layers.%d.fc._extra_state" % k] = value
    sd["layers.9.norm._extra_state"] = tl.uint8_tensor(b"")      # stateless module
    sd["layers.8.norm._extra_state"] = tl.uint8_tensor(tl.plain_pickle(None))
    tl.torch_save(sd, tmp_path / "te.pt")
    ferry("convert", tmp_path / "te.pt", tmp_path / "te.ferry")
    got = tf.read_scaling_state(str(tmp_path / "te.ferry"))
    assert set(got) == {"layers.%d.fc" % k for k in range(len(forms))} | {
        "layers.9.norm", "layers.8.norm"}
    assert got["layers.9.norm"] == {"recipe": None, "states": []}
    assert got["layers.8.norm"] == {"recipe": None, "states": []}
    for k, (form, _, arrays) in enumerate(forms):
        entry = got["layers.%d.fc" % k]
        assert entry["recipe"] == recipe_dict, form
        fwd, bwd = entry["states"]
        assert fwd["direction"] == "forward" and fwd["num_gemms"] == 2
        assert fwd["slot_roles"] == ["input", "weight", "output"] * 2
        assert bwd["slot_roles"] == ["grad_output", "grad_input"] * 2
        np.testing.assert_array_equal(fwd["scale"], arrays["scale_fwd"], err_msg=form)
        np.testing.assert_array_equal(fwd["amax_history"], arrays["amax_history_fwd"])
        np.testing.assert_array_equal(bwd["scale"], arrays["scale_bwd"])
        np.testing.assert_array_equal(bwd["amax_history"], arrays["amax_history_bwd"])
    md = tf.read_metadata(str(tmp_path / "te.ferry"))
    assert json.loads(md["transformer_engine.extra_fp8_variables.layers.0.fc"]) == {
        "num_gemms": 2, "fp8_checkpoint": True, "fp8_max_fwd": 448.0}
    assert list(ferry_bytes(tmp_path / "te.ferry")) == ["fc.weight"]


def test_extra_state_builder_structure():
    """tensorferry.torch's inverse: the dict a TransformerEngine module's set_extra_state reads,
    built from the tables (checked here without torch)."""
    from tensorferry import _te

    rng = np.random.default_rng(0)
    entry = {"recipe": {"type": "DelayedScaling", "margin": 0, "fp8_format": "HYBRID",
                        "amax_history_len": 4, "amax_compute_algo": "max",
                        "reduce_amax": True, "fp8_dpa": False, "fp8_mha": False},
             "states": [{"direction": "forward", "num_gemms": 1,
                         "slot_roles": ["input", "weight", "output"],
                         "scale": rng.random(3, dtype=np.float32),
                         "amax_history": rng.random((4, 3), dtype=np.float32)},
                        {"direction": "backward", "num_gemms": 1,
                         "slot_roles": ["grad_output", "grad_input"],
                         "scale": rng.random(2, dtype=np.float32),
                         "amax_history": rng.random((4, 2), dtype=np.float32)}]}
    d = _te.extra_state_dict(entry, {"num_gemms": 1, "fp8_checkpoint": True},
                             to_tensor=lambda a: a)
    assert set(d) == {"scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd",
                      "extra_fp8_variables"}
    np.testing.assert_array_equal(d["amax_history_fwd"], entry["states"][0]["amax_history"])
    assert d["extra_fp8_variables"] == {"num_gemms": 1, "fp8_checkpoint": True}
    assert _te.extra_state_dict({"recipe": None, "states": []}, None, to_tensor=lambda a: a) \
        is None


# ---- hostile and malformed inputs ------------------------------------------------------------

class _System:
    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def _raw_pickle_zip(pkl, storages=None, root="archive"):
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr(root + "/data.pkl", pkl)
        for k, v in (storages or {}).items():
            z.writestr(root + "/data/" + k, v)
    return out.getvalue()


def _hostile_cases(marker):
    cmd = "touch " + marker
    cases = {}
    cases["os.system via REDUCE"] = (
        _raw_pickle_zip(pickle.dumps({"w": _System(cmd)}, protocol=2)),
        ["refused global 'posix.system'", "byte"])
    cases["os.system via STACK_GLOBAL from memo"] = (
        _raw_pickle_zip(pickle.dumps([_System(cmd), _System(cmd)], protocol=4)),
        ["refused global 'posix.system'"])
    # Nested: the callable hides inside a tensor's arguments.
    t = tl.tensor(np.ones(2, np.float32))
    t.offset = _System(cmd)
    cases["global nested in tensor arguments"] = (
        tl.torch_save_bytes({"w": t}), ["refused global 'posix.system'"])
    cases["builtins.eval"] = (
        _raw_pickle_zip(b"\x80\x02cbuiltins\neval\nX\x08\x00\x00\x00__import__\x85R."),
        ["refused global 'builtins.eval'"])
    cases["INST"] = (_raw_pickle_zip(b"\x80\x02(X\x01\x00\x00\x00xios\nsystem\n."),
                     ["refused opcode INST"])
    cases["OBJ"] = (_raw_pickle_zip(b"\x80\x02(ctorch\nSize\no."), ["refused opcode OBJ"])
    cases["NEWOBJ of an allowed callable"] = (
        _raw_pickle_zip(b"\x80\x02ccollections\nOrderedDict\n)\x81."),
        ["NEWOBJ of 'collections.OrderedDict'"])
    cases["BUILD on a plain value"] = (_raw_pickle_zip(b"\x80\x02K\x01}b."),
                                       ["BUILD on a value"])
    cases["huge length prefix"] = (
        _raw_pickle_zip(b"\x80\x04\x8d" + struct.pack("<Q", 1 << 62) + b"x."),
        ["truncated pickle"])
    cases["deep MARK nesting"] = (_raw_pickle_zip(b"\x80\x02" + b"(" * 5000 + b"."),
                                  ["MARKs nested deeper than"])
    cases["self-referencing dict"] = (
        _raw_pickle_zip(b"\x80\x02}q\x00X\x01\x00\x00\x00ah\x00s."), ["nests deeper than 64"])
    cases["protocol 0"] = (_raw_pickle_zip(b"(dp0\n."), ["only protocols 2 to 5"])
    # Storages that point outside their data.
    big = tl.Tensor(tl.Storage(np.ones(4, np.float32).tobytes(), "float32"), (4, 4))
    cases["tensor past its storage"] = (tl.torch_save_bytes({"w": big}),
                                        ["reaches byte 64 of storage '0', which holds 16"])
    pid_pkl = (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n(X\x07\x00\x00\x00storage"
               b"ctorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuJ\x00\x00\x00\x01"
               b"tQK\x00K\x01\x85K\x01\x85\x89ccollections\nOrderedDict\n)Rtr.")
    cases["storage numel larger than its entry"] = (
        _raw_pickle_zip(pid_pkl, {"0": b"\0" * 16}), ["claims 67108864 bytes; its entry holds 16"])
    cases["storage without an entry"] = (_raw_pickle_zip(pid_pkl),
                                         ["has no entry 'archive/data/0'"])
    # Zip-level: a compressed data.pkl (a bomb would be compressed), overlapping entries,
    # an entry count the directory cannot hold, a truncated archive.
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", b"\x80\x02}." + b"\0" * 100000)
    cases["compressed entry"] = (out.getvalue(), ["is compressed"])
    good = tl.torch_save_bytes({"w": tl.tensor(np.ones(3, np.float32))})
    cd = good.rfind(b"PK\x01\x02")  # last central directory entry: point it at the first local header
    overlap = bytearray(good)
    overlap[cd + 42:cd + 46] = b"\0\0\0\0"
    cases["overlapping entries"] = (bytes(overlap), ["disagrees", "overlap"])
    eocd = good.rfind(b"PK\x05\x06")
    many = bytearray(good)
    many[eocd + 10:eocd + 12] = b"\xff\xfe"
    cases["entry count past the directory"] = (bytes(many), ["entries in"])
    cases["truncated archive"] = (good[:len(good) // 2], ["no zip end of central directory"])
    legacy = io.BytesIO()
    pickle.dump(0x1950a86a20f9469cfc6c, legacy, protocol=2)
    cases["legacy torch.save"] = (legacy.getvalue() + b"\0" * 32, ["legacy torch.save file"])
    return cases


@needs_ferry
def test_hostile_pickles_are_refused_and_nothing_runs(tmp_path):
    marker = str(tmp_path / "pwned")
    for name, (blob, messages) in _hostile_cases(marker).items():
        path = tmp_path / "hostile.pt"
        path.write_bytes(blob)
        for cmd in ("inspect", "convert"):
            args = [cmd, path] + ([tmp_path / "out.ferry"] if cmd == "convert" else [])
            p = subprocess.run([FERRY, *map(str, args)], capture_output=True, text=True,
                               timeout=60)
            assert p.returncode == 1, (name, p.stdout, p.stderr)
            assert "hostile.pt" in p.stderr, (name, p.stderr)
            assert any(m in p.stderr for m in messages), (name, p.stderr)
            assert "Internal" not in p.stderr
        assert not os.path.exists(marker), name
        assert not (tmp_path / "out.ferry").exists()
    # The Python entry point refuses the same way.
    tf = _tensorferry()
    path.write_bytes(_hostile_cases(marker)["os.system via REDUCE"][0])
    with pytest.raises(tf.DataLossError, match="refused global 'posix.system'"):
        tf.convert(path, tmp_path / "out.ferry")
    assert not os.path.exists(marker)


# ---- checkpoints written by the real torch (tests/data/torch, made by make_fixtures.py) -------

def _manifest():
    path = os.path.join(FIXTURES, "manifest.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


@needs_ferry
def test_real_torch_fixtures(tmp_path):
    manifest = _manifest()
    if manifest is None:
        pytest.skip("no fixtures from the real torch under tests/data/torch")
    tf = _tensorferry()
    import hashlib

    for case in manifest["cases"]:
        src = os.path.join(FIXTURES, case["path"])
        out = tmp_path / (case["name"] + ".ferry")
        if case.get("error"):
            p = ferry("convert", src, out, expect=1)
            assert case["error"] in p.stderr, (case["name"], p.stderr)
            continue
        ferry("convert", src, out)
        got = ferry_bytes(out)
        assert sorted(got) == sorted(case["tensors"]), case["name"]
        for name, want in case["tensors"].items():
            dtype, shape, data = got[name]
            assert dtype == want["dtype"] and shape == want["shape"], (case["name"], name)
            assert hashlib.sha256(data).hexdigest() == want["sha256"], (case["name"], name)
        if "scaling" in case:
            state = tf.read_scaling_state(str(out))
            stateless = case.get("stateless", [])
            assert sorted(state) == sorted(list(case["scaling"]) + stateless), case["name"]
            for module in stateless:
                assert state[module] == {"recipe": None, "states": []}
            for module, want in case["scaling"].items():
                got_states = state[module]["states"]
                assert [s["direction"] for s in got_states] == [w["direction"] for w in want]
                for s, w in zip(got_states, want):
                    np.testing.assert_array_equal(s["scale"], np.array(w["scale"], np.float32))
                    np.testing.assert_array_equal(
                        s["amax_history"], np.array(w["amax_history"], np.float32))


def test_python_convert_of_safetensors_and_ferry_inputs(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    tf = _tensorferry()
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, np.int64)}
    safetensors_numpy.save_file(arrays, str(tmp_path / "m.safetensors"), metadata={"k": "v"})
    tf.convert(tmp_path / "m.safetensors", tmp_path / "m.ferry", encoding="zstd")
    tf.convert(tmp_path / "m.ferry", tmp_path / "again.ferry")
    got = ferry_bytes(tmp_path / "again.ferry")
    assert {n: v[2] for n, v in got.items()} == {n: a.tobytes() for n, a in arrays.items()}
    assert tf.read_metadata(str(tmp_path / "again.ferry"))["k"] == "v"
    with pytest.raises(tf.UnimplementedError, match="ferry convert"):
        tf.convert(tmp_path / "m.ferry", tmp_path / "x.safetensors")
    with pytest.raises(tf.NotFoundError):
        tf.convert(tmp_path / "missing.pt", tmp_path / "y.ferry")


# ---- hostile inputs, round three (issue 23, items 12-17, 20, 21) -----------------------------

def _run(*args, limit_kib=None, timeout=120):
    """`ferry` with bytes output, optionally under an address-space limit (`ulimit -v`)."""
    cmd = [FERRY, *map(str, args)]
    if limit_kib is not None:
        cmd = ["bash", "-c", 'ulimit -v %d && exec "$@"' % limit_kib, "ferry", *cmd]
    return subprocess.run(cmd, capture_output=True, timeout=timeout)


# Terminal controls (OSC title, BEL, CSI, DEL, the C1 CSI U+009B), a quote, and bytes that are
# not UTF-8 (pickle writes a lone surrogate as ED B3 BF).
EVIL = "\x1b]0;owned\x07\x1b[2J\u009b31m\x7f'\udcff"


def _assert_printable(out):
    for bad in (b"\x1b", b"\x07", b"\x7f", b"\xc2\x9b", b"\xed\xb3\xbf"):
        assert bad not in out, (bad, out)


@needs_ferry
def test_cli_escapes_everything_from_a_torch_checkpoint(tmp_path):
    """Names, keys, values, storage locations, module names and skipped entries: every output
    path of inspect (text and --json), convert and errors."""
    st = tl.Storage(np.ones(4, np.float32).tobytes(), "float32", location="cuda:" + EVIL)
    te, _ = tl.te_state(tl.recipe.DelayedScaling(), make=tl.plain_tensor)
    sd = {"w" + EVIL: tl.Tensor(st, (2, 2)), "k" + EVIL: "v" + EVIL,
          "m" + EVIL + "._extra_state": tl.uint8_tensor(tl.plain_pickle(te)),
          "o" + EVIL: tl._FAKES["torch.distributed.checkpoint.metadata"].BytesStorageMetadata()}
    src = tmp_path / "evil.pt"
    tl.torch_save(sd, src)
    p = _run("inspect", src)
    assert p.returncode == 0, p.stderr
    _assert_printable(p.stdout + p.stderr)
    esc = rb"\x1b]0;owned\x07\x1b[2J\xc2\x9b31m\x7f'\xed\xb3\xbf"
    assert b"w" + esc + b"  F32  [2, 2]" in p.stdout, p.stdout
    assert b"saved from cuda:" + esc in p.stdout
    assert b"  k" + esc + b" = v" + esc in p.stdout
    assert b"  m" + esc + b": DelayedScaling" in p.stdout
    # Warnings: the name quoted as in every message, escaped once (no \x5cx27).
    qesc = rb"\x1b]0;owned\x07\x1b[2J\xc2\x9b31m\x7f\x27\xed\xb3\xbf"
    assert b"ferry: warning: not imported: " in p.stderr
    assert b"'o" + qesc + b"': a torch.distributed" in p.stderr, p.stderr
    assert b"\\x5c" not in p.stderr
    j = _run("inspect", "--json", src)
    assert j.returncode == 0, j.stderr
    assert all(32 <= c < 127 or c in b"\n" for c in j.stdout), j.stdout
    info = json.loads(j.stdout)
    fixed = EVIL.replace("\udcff", "\ufffd" * 3)  # each byte not UTF-8 becomes U+FFFD
    assert info["tensors"][0]["name"] == "w" + fixed
    assert info["tensors"][0]["saved_location"] == "cuda:" + fixed
    assert info["metadata"]["k" + fixed] == "v" + fixed
    c = _run("convert", src, tmp_path / "out.ferry")
    assert c.returncode == 0, c.stderr
    _assert_printable(c.stdout + c.stderr)
    assert b"'o" + qesc + b"'" in c.stderr
    # Errors: a tensor TensorFerry cannot store, named in the message.
    tl.torch_save({"c" + EVIL: tl.tensor(np.zeros(2, np.float32), dtype="complex32")}, src)
    for args in (("inspect", src), ("convert", src, tmp_path / "x.ferry")):
        e = _run(*args)
        assert e.returncode == 1
        _assert_printable(e.stdout + e.stderr)
        assert b"tensor 'c" + qesc + b"' is torch.complex32" in e.stderr, e.stderr


@needs_ferry
def test_shared_references_do_not_hang_the_walk(tmp_path):
    """The same list twice, nested 60 deep: 2^60 paths in a few hundred bytes."""
    x = []
    for _ in range(60):
        x = [x, x]
    tl.torch_save({"x": x}, tmp_path / "m.pt")
    assert (tmp_path / "m.pt").stat().st_size < 2000
    p = _run("inspect", tmp_path / "m.pt", timeout=60)
    assert p.returncode == 1, p.stderr
    assert b"ResourceExhausted" in p.stderr and b"through shared references" in p.stderr


@needs_ferry
def test_shared_arguments_keep_memory_linear(tmp_path):
    """A 1.1 MB pickle calling a recipe class 160,000 times with one 100,000-item argument
    tuple: each call copied the tuple (over 100 GB). Now memory follows the pickle: it opens
    under a 1 GiB address-space limit."""
    n, m = 100000, 160000
    pkl = (b"\x80\x02ctransformer_engine.common.recipe\nFormat\nq\x000K\x07q\x010("
           + b"h\x01" * n + b"tq\x020" + b"h\x00h\x02R0" * m + b"}.")
    assert 1_000_000 < len(pkl) < 1_200_000
    (tmp_path / "m.pt").write_bytes(_raw_pickle_zip(pkl))
    p = _run("inspect", tmp_path / "m.pt", limit_kib=1 << 20)
    assert p.returncode == 0, (p.returncode, p.stderr)
    assert b"tensors    0" in p.stdout


class _HookedTensor(tl.Tensor):
    """A tensor whose backward-hooks argument is a list of `n` ints (a pickle of ~2 MB)."""

    def __init__(self, t, n):
        super().__init__(t.storage, t.shape)
        self.n = n

    def __reduce_ex__(self, protocol):
        fn, args = super().__reduce_ex__(protocol)
        return fn, args[:5] + (list(range(self.n)),)


@needs_ferry
def test_dcp_chunks_naming_one_item_are_refused(tmp_path):
    """600 chunks over one 2 MB item (a few KB of .metadata): each was parsed again, past
    1 GiB. Each item of a data file is read once now."""
    meta = tl._FAKES["torch.distributed.checkpoint.metadata"]
    fsm = tl._FAKES["torch.distributed.checkpoint.filesystem"]
    ck = tmp_path / "ckpt"
    ck.mkdir()
    blob = tl.torch_save_bytes(_HookedTensor(tl.tensor(np.ones((1, 1), np.float32)), 400000))
    assert len(blob) > 1_500_000
    (ck / "__0_0.distcp").write_bytes(blob)
    info = fsm._StorageInfo("__0_0.distcp", 0, len(blob))
    Size = tl.torch.Size
    chunks = [meta.ChunkStorageMetadata(Size((i, 0)), Size((1, 1))) for i in range(600)]
    storage = {meta.MetadataIndex("w", Size((i, 0)), i): info for i in range(600)}
    md = meta.Metadata(state_dict_metadata={"w": meta.TensorStorageMetadata(
        meta.TensorProperties(tl.torch.float32), Size((600, 1)), chunks)},
        planner_data={}, storage_data=storage)
    with tl.fake_modules():
        (ck / ".metadata").write_bytes(pickle.dumps(md, protocol=4))
    p = _run("inspect", ck, limit_kib=1 << 20)
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert b"tensor 'w' chunk 1 (bytes 0 to %d) and tensor 'w' chunk 0" % len(blob) in p.stderr
    assert b"each item of a data file is read once" in p.stderr


@needs_ferry
def test_empty_dcp_files_are_clean_errors(tmp_path):
    ck = tmp_path / "ckpt"
    ck.mkdir()
    (ck / ".metadata").write_bytes(b"")
    p = _run("inspect", ck)
    assert p.returncode == 1 and b".metadata: not a pickle" in p.stderr, p.stderr


@needs_ferry
def test_huge_views_are_refused_by_their_counts(tmp_path):
    """A broadcast view of 2^62 float32 elements over 4 bytes: 2^64 bytes, which wrapped to 0
    and was converted as an empty tensor of that shape."""
    t = tl.Tensor(tl.Storage(np.ones(1, np.float32).tobytes(), "float32"), (1 << 62,),
                  stride=(0,))
    tl.torch_save({"w": t}, tmp_path / "m.pt")
    p = _run("convert", tmp_path / "m.pt", tmp_path / "m.ferry")
    assert p.returncode == 1, p.stderr
    assert b"size [4611686018427387904] of float32 is more than 2^63 bytes" in p.stderr, p.stderr
    assert not (tmp_path / "m.ferry").exists()


@needs_ferry
def test_sharded_bin_index_with_a_tensor_in_two_shards(tmp_path):
    a = tl.tensor(np.ones(2, np.float32))
    tl.torch_save({"a": a}, tmp_path / "s1.bin")
    tl.torch_save({"a": a, "b": tl.tensor(np.zeros(2, np.float32))}, tmp_path / "s2.bin")
    (tmp_path / "m.bin.index.json").write_text(
        json.dumps({"weight_map": {"a": "s1.bin", "b": "s2.bin"}}))
    p = _run("convert", tmp_path / "m.bin.index.json", tmp_path / "m.ferry")
    assert p.returncode == 1
    assert (b"tensor 'a' is in two shards: %s and %s" % (
        str(tmp_path / "s1.bin").encode(), str(tmp_path / "s2.bin").encode())) in p.stderr, p.stderr


@needs_ferry
def test_to_safetensors_writes_only_what_reads_back(tmp_path):
    """Names with NUL or over 64 KiB and empty metadata keys made files TensorFerry refused."""
    tf = _tensorferry()
    w = tl.tensor(np.ones(2, np.float32))
    cases = [({"a\0b": w}, "tensor name 'a\\x00b' contains a NUL byte"),
             ({"n" * 70000: w}, "is 70000 bytes (limit 65536)"),
             ({"w": w, "": 5}, "metadata key '' is empty")]
    for sd, message in cases:
        tl.torch_save(sd, tmp_path / "m.pt")
        out = tmp_path / "m.safetensors"
        p = _run("convert", tmp_path / "m.pt", out)
        assert p.returncode == 1 and message.encode() in p.stderr, p.stderr
        assert not out.exists()
        with pytest.raises(tf.InvalidArgumentError, match=re.escape(message)):
            tf.convert(tmp_path / "m.pt", out)
        assert not out.exists()


def test_plain_values_come_back_typed(tmp_path):
    tf = _tensorferry()
    from tensorferry import _state
    values = {"one": 1.0, "tenth": 0.1, "big": 1e20, "small": 1e-5, "whole": 1e15,
              "neg_zero": -0.0, "nan": float("nan"), "inf": float("inf"),
              "ninf": float("-inf"), "step": 10, "flag": True, "off": False, "none": None,
              "name": "adam", "betas": [0.9, 0.999], "shape": [1.0, 2.0]}
    tl.torch_save(dict(values, w=tl.tensor(np.ones(2, np.float32))), tmp_path / "m.pt")
    tf.convert(str(tmp_path / "m.pt"), str(tmp_path / "m.ferry"))
    texts = tf.read_metadata(str(tmp_path / "m.ferry"))
    # The same texts the Python flattening writes for these values (tensorferry.torch).
    _, want_texts, _ = _state.flatten(values, lambda v: False)
    assert {k: texts[k] for k in values} == want_texts
    assert texts["one"] == "1.0" and texts["big"] == "1e+20" and texts["shape"] == "[1.0, 2.0]"
    typed = tf.read_metadata(str(tmp_path / "m.ferry"), typed=True)
    for k, v in values.items():
        got = typed[k]
        assert type(got) is type(v), (k, got)
        if isinstance(v, float) and v != v:
            assert got != got
        elif isinstance(v, float):
            assert got == v and str(got) == str(v), (k, got)
        else:
            assert got == v, (k, got)
