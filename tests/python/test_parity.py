"""safetensors parity: the same calls against safetensors and tensorferry on the same data give
the same results, or the difference the docstrings document (tensorferry.safe_open,
tensorferry.numpy, tensorferry.torch). Runs in the source tree and, through test_package.py,
against the package pip installed into a fresh virtual environment."""

import importlib.metadata
import os

import numpy as np
import pytest

import tensorferry
import tensorferry.numpy as tfn

safetensors = pytest.importorskip("safetensors")
import safetensors.numpy as stn  # noqa: E402


def data():
    rng = np.random.default_rng(7)
    return {
        "w": rng.standard_normal((6, 5)).astype(np.float32),
        "i": np.arange(24, dtype=np.int64).reshape(2, 3, 4),
        "h": rng.standard_normal(9).astype(np.float16),
        "u": np.arange(7, dtype=np.uint8),
        "s": np.array(2.5, dtype=np.float64),
        "e": np.zeros((0, 3), dtype=np.int32),
        "b": np.array([True, False, True]),
    }


def same(a, b):
    assert type(a) is type(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


@pytest.fixture
def files(tmp_path):
    d = data()
    st, tf = str(tmp_path / "m.safetensors"), str(tmp_path / "m.ferry")
    stn.save_file(d, st)
    tfn.save_file(d, tf)
    return st, tf, d


def test_version_and_installed_library():
    assert tensorferry.__version__ == tensorferry.version()
    if os.environ.get("TENSORFERRY_EXPECT_INSTALLED") != "1":
        return
    # Installed by pip: the package found its own library, with no environment variable.
    assert "TENSORFERRY_LIBRARY" not in os.environ
    here = os.path.dirname(os.path.abspath(tensorferry.__file__))
    assert "site-packages" in here
    assert os.path.dirname(os.path.abspath(tensorferry.library_path())) == here
    assert [f for f in os.listdir(here) if f.startswith("libferry")] == ["libferry.so"]
    assert importlib.metadata.version("tensorferry") == tensorferry.__version__


def test_numpy_files_round_trip(files):
    st, tf, d = files
    a, b = stn.load_file(st), tfn.load_file(tf)
    assert sorted(a) == sorted(b) == sorted(d)
    for k in d:
        same(a[k], b[k])
        assert a[k].flags.writeable == b[k].flags.writeable


def test_numpy_bytes_round_trip():
    d = data()
    raw_st, raw_tf = stn.save(d), tfn.save(d, metadata={"k": "v"})
    assert type(raw_st) is type(raw_tf) is bytes
    a, b = stn.load(raw_st), tfn.load(raw_tf)
    assert sorted(a) == sorted(b)
    for k in d:
        same(a[k], b[k])
    with pytest.raises(Exception):
        stn.load(b"garbage")
    with pytest.raises(tensorferry.DataLossError):
        tfn.load(b"garbage")


def test_metadata(tmp_path):
    d = {"x": np.ones(2, np.float32)}
    for meta, want_st, want_tf in [(None, None, None), ({"step": "3"}, {"step": "3"},
                                                        {"step": "3"}),
                                   ({}, {}, None)]:  # documented: {} reads back as None
        stn.save_file(d, str(tmp_path / "a.safetensors"), metadata=meta)
        tfn.save_file(d, str(tmp_path / "a.ferry"), metadata=meta)
        with safetensors.safe_open(str(tmp_path / "a.safetensors"), "np") as f:
            assert f.metadata() == want_st
        with tensorferry.safe_open(str(tmp_path / "a.ferry"), "np") as f:
            assert f.metadata() == want_tf
    with pytest.raises(TypeError):
        stn.save_file(d, str(tmp_path / "b.safetensors"), metadata={"k": 1})
    with pytest.raises(TypeError):
        tfn.save_file(d, str(tmp_path / "b.ferry"), metadata={"k": 1})


def test_missing_file_is_file_not_found(tmp_path):
    missing = str(tmp_path / "nothing")
    for call in (lambda: safetensors.safe_open(missing, "np"), lambda: stn.load_file(missing)):
        with pytest.raises(FileNotFoundError):
            call()
    for call in (lambda: tensorferry.safe_open(missing, "np"), lambda: tfn.load_file(missing),
                 lambda: tensorferry.load_file(missing)):
        with pytest.raises(FileNotFoundError, match="nothing"):
            call()


def test_safe_open_keys_tensors_and_closed_handle(files):
    st, tf, d = files
    with safetensors.safe_open(st, "np") as a, tensorferry.safe_open(tf, "np") as b:
        assert a.keys() == b.keys()
        for k in d:
            x, y = a.get_tensor(k), b.get_tensor(k)
            same(x, y)
            assert x.flags.writeable and y.flags.writeable
        with pytest.raises(Exception):
            a.get_tensor("nope")
        with pytest.raises(LookupError):  # documented: NotFoundError, not SafetensorError
            b.get_tensor("nope")
    # After the with block both files are closed: every call raises.
    for call in ("keys", "metadata"):
        with pytest.raises(Exception):
            getattr(a, call)()
        with pytest.raises(ValueError, match="closed"):
            getattr(b, call)()
    with pytest.raises(Exception):
        a.get_tensor("w")
    with pytest.raises(ValueError, match="closed"):
        b.get_tensor("w")
    with pytest.raises(ValueError, match="closed"):
        b.get_slice("w")


def test_writes_to_a_tensor_never_reach_the_file(files):
    st, tf, d = files
    before = open(tf, "rb").read()
    with tensorferry.safe_open(tf, "np") as f:
        w = f.get_tensor("w")
        w[:] = 0
        same(f.get_tensor("w"), d["w"])
    assert open(tf, "rb").read() == before


GOOD = [Ellipsis, (), 1, -1, slice(1, 3), slice(0, 6), slice(None, None, 2), slice(1, None, 3),
        (slice(None), slice(1, 2)), (1, 2), (1, -1), (Ellipsis, 1), (slice(2, 4), Ellipsis),
        slice(3, 3), (slice(None), slice(0, 5))]
# Int indices past a dimension raise; slices past it clamp, as in Python, numpy and torch.
BAD = [6, -7, (0, 5), (slice(None), 5)]
CLAMPED = [slice(5, 9), slice(2, 9), slice(6, 6), slice(6, None), slice(None, 7), slice(-10, 2),
           slice(-10, None), slice(9, 2, -1), (slice(None), slice(0, 6)),
           (slice(None), slice(-9, 9, 2)), (Ellipsis, slice(3, 99))]


@pytest.mark.parametrize("key", GOOD, ids=repr)
def test_get_slice_same_results(files, key):
    st, tf, _ = files
    with safetensors.safe_open(st, "np") as a, tensorferry.safe_open(tf, "np") as b:
        same(np.asarray(a.get_slice("w")[key]), np.asarray(b.get_slice("w")[key]))
        assert a.get_slice("w").get_shape() == b.get_slice("w").get_shape()
        assert a.get_slice("w").get_dtype() == b.get_slice("w").get_dtype()
        if key in (Ellipsis, ()):
            same(np.asarray(a.get_slice("s")[key]), np.asarray(b.get_slice("s")[key]))


@pytest.mark.parametrize("key", BAD, ids=repr)
def test_get_slice_out_of_range_raises(files, key):
    st, tf, _ = files
    with safetensors.safe_open(st, "np") as a, tensorferry.safe_open(tf, "np") as b:
        with pytest.raises(Exception):
            a.get_slice("w")[key]
        with pytest.raises(IndexError, match="'w'"):  # documented: IndexError
            b.get_slice("w")[key]


@pytest.mark.parametrize("key", CLAMPED, ids=repr)
def test_get_slice_clamps_like_numpy(files, key):
    st, tf, d = files
    with safetensors.safe_open(st, "np") as a, tensorferry.safe_open(tf, "np") as b:
        got = np.asarray(b.get_slice("w")[key])
        same(got, d["w"][key])
        try:
            theirs = np.asarray(a.get_slice("w")[key])
        except Exception:  # noqa: BLE001 - the installed safetensors refuses some of these
            return
        same(got, theirs)


def test_get_slice_tensor_parallel_last_rank(tmp_path):
    # A split of 3 rows in pieces of 2: the last rank asks for [2:4] and gets one row.
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    for enc in ("raw", "zstd"):
        path = str(tmp_path / ("w_%s.ferry" % enc))
        tensorferry.save_file({"w": w}, path, encoding=enc)
        with tensorferry.safe_open(path, "np") as f:
            s = f.get_slice("w")
            assert s[1:10].shape == (2, 4) and s[5:].shape == (0, 4)
            assert s[-10:].shape == (3, 4)
            same(s[2:4], w[2:4])
            same(s[1:10], w[1:10])


def test_get_slice_negative_bounds_and_steps(files):
    # Documented difference: Python's meaning (safetensors rejects negative slice bounds).
    _, tf, d = files
    with tensorferry.safe_open(tf, "np") as f:
        s = f.get_slice("w")
        for key in [slice(-2, None), slice(None, -1), slice(None, None, -1), slice(4, 0, -2),
                    (slice(-3, -1), slice(None, None, -2)), slice(0, 4, -1)]:
            same(np.asarray(s[key]), d["w"][key])


# ---- torch --------------------------------------------------------------------------------


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


def torch_data(torch):
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(6, 5, generator=g),
        "bf": torch.randn(4, 4, generator=g).to(torch.bfloat16),
        "i": torch.arange(10, dtype=torch.int32),
        "s": torch.tensor(1.5, dtype=torch.float64),
    }


def same_t(torch, a, b):
    assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
    a, b = a.cpu().contiguous(), b.cpu().contiguous()
    assert torch.equal(a.view(torch.uint8) if a.dim() else a,
                       b.view(torch.uint8) if b.dim() else b)


def test_torch_files_and_bytes(torch, tmp_path):
    import safetensors.torch as stt
    import tensorferry.torch as tft

    d = torch_data(torch)
    stt.save_file(d, str(tmp_path / "a.safetensors"), metadata={"m": "1"})
    tft.save_file(d, str(tmp_path / "a.ferry"), metadata={"m": "1"})
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        a = stt.load_file(str(tmp_path / "a.safetensors"), device=device)
        b = tft.load_file(str(tmp_path / "a.ferry"), device=device)
        assert sorted(a) == sorted(b)
        for k in d:
            same_t(torch, a[k], b[k])
    a, b = stt.load(stt.save(d)), tft.load(tft.save(d))
    for k in d:
        same_t(torch, a[k], b[k])
    with safetensors.safe_open(str(tmp_path / "a.safetensors"), "pt") as x, \
            tensorferry.safe_open(str(tmp_path / "a.ferry"), "pt") as y:
        for key in [Ellipsis, 1, slice(1, 4), (slice(None), slice(0, 2)), slice(None, None, 2)]:
            same_t(torch, x.get_slice("w")[key], y.get_slice("w")[key])


def test_torch_refuses_shared_tensors(torch, tmp_path):
    import safetensors.torch as stt
    import tensorferry.torch as tft

    base = torch.zeros(10)
    shared = {"a": base, "b": base[:5], "c": torch.ones(3)}
    with pytest.raises(RuntimeError):
        stt.save_file(shared, str(tmp_path / "s.safetensors"))
    with pytest.raises(RuntimeError, match=r"\{'a', 'b'\}"):
        tft.save_file(shared, str(tmp_path / "s.ferry"))
    assert not os.path.exists(str(tmp_path / "s.ferry"))
    with pytest.raises(ValueError):
        stt.save_file({"a": 1}, str(tmp_path / "s.safetensors"))
    with pytest.raises(ValueError):
        tft.save_file({"a": 1}, str(tmp_path / "s.ferry"))


def _tied_model(torch):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(8, 4)
            self.head = torch.nn.Linear(4, 8, bias=True)
            self.head.weight = self.emb.weight  # tied, as in language models
            self.register_buffer("steps", torch.tensor(0, dtype=torch.int64))

    return Tied()


def test_torch_save_model_load_model(torch, tmp_path):
    import safetensors.torch as stt
    import tensorferry.torch as tft

    torch.manual_seed(0)
    src = _tied_model(torch)
    src.steps += 5
    stt.save_model(src, str(tmp_path / "m.safetensors"))
    tft.save_model(src, str(tmp_path / "m.ferry"))
    with safetensors.safe_open(str(tmp_path / "m.safetensors"), "pt") as f:
        st_keys, st_meta = f.keys(), f.metadata()
    with tensorferry.safe_open(str(tmp_path / "m.ferry"), "pt") as f:
        assert f.keys() == st_keys
        assert f.metadata() == st_meta
    for strict in (True, False):
        a, b = _tied_model(torch), _tied_model(torch)
        ra = stt.load_model(a, str(tmp_path / "m.safetensors"), strict=strict)
        rb = tft.load_model(b, str(tmp_path / "m.ferry"), strict=strict)
        assert ra == rb
        for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
            assert ka == kb
            same_t(torch, va, vb)
            same_t(torch, vb, src.state_dict()[kb])
        assert b.head.weight.data_ptr() == b.emb.weight.data_ptr()  # still tied

    # A model with a missing and an unexpected name: same error, same lists.
    class Other(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(8, 4)
            self.extra = torch.nn.Parameter(torch.zeros(2))

    for path, mod in ((tmp_path / "m.safetensors", stt), (tmp_path / "m.ferry", tft)):
        with pytest.raises(RuntimeError) as e:
            mod.load_model(Other(), str(path))
        if mod is stt:
            st_error = str(e.value)
        else:
            assert str(e.value) == st_error
    ra = stt.load_model(Other(), str(tmp_path / "m.safetensors"), strict=False)
    rb = tft.load_model(Other(), str(tmp_path / "m.ferry"), strict=False)
    assert (ra[0], sorted(ra[1])) == (rb[0], sorted(rb[1]))

    # Shape mismatch: torch's own error through load_state_dict, as in safetensors.
    wrong = _tied_model(torch)
    wrong.head.bias = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(RuntimeError, match="size mismatch"):
        stt.load_model(wrong, str(tmp_path / "m.safetensors"))
    with pytest.raises(RuntimeError, match="size mismatch"):
        tft.load_model(wrong, str(tmp_path / "m.ferry"))
