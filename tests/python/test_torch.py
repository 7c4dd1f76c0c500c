"""tensorferry with torch: CPU round trips, state_dict and scaling state; on CUDA machines,
current-device placement, explicit devices and stream ordering. Skipped without torch; the CUDA
tests are skipped without a usable GPU."""

import numpy as np
import pytest

import tensorferry as tf
from corrupt import flip_data_byte

torch = pytest.importorskip("torch")
tft = pytest.importorskip("tensorferry.torch")

HAS_CUDA = torch.cuda.is_available() and tf.cuda_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build")
needs_2_gpus = pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2,
                                  reason="needs 2 CUDA devices")

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
          torch.complex128]
for _name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
              "float8_e5m2fnuz", "float8_e8m0fnu"):
    if hasattr(torch, _name):
        DTYPES.append(getattr(torch, _name))


def make(dtype, shape=(4, 6), device="cpu"):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 3
    if dtype.is_complex:
        return torch.complex(x, -x).to(dtype).to(device)
    if dtype == torch.bool:
        return (x > 0).to(device)
    if getattr(torch, "float8_e8m0fnu", None) == dtype:
        return torch.full(shape, 2.0).to(dtype).to(device)
    if dtype.is_floating_point:
        return x.to(dtype).to(device)
    return x.abs().to(torch.int64).clamp(0, 100).to(dtype).to(device)


def same(a, b):
    assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape), (a.dtype, b.dtype)
    a, b = a.cpu().contiguous(), b.cpu().contiguous()
    if a.element_size() == 0 or a.numel() == 0:
        return
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.fixture
def path(tmp_path):
    return str(tmp_path / "t.ferry")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_round_trip(path, dtype):
    x = make(dtype)
    tf.save_file({"x": x, "s": make(dtype, ())}, path, encoding="shuffle_zstd")
    out = tf.load_file(path, framework="pt")
    same(out["x"], x)
    same(out["s"], make(dtype, ()))
    with tf.safe_open(path, framework="pt") as f:
        same(f.get_slice("x")[1:3], x[1:3])


def test_fp4_x2(path):
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("torch without float4_e2m1fn_x2")
    packed = torch.arange(12, dtype=torch.uint8).reshape(3, 4).view(torch.float4_e2m1fn_x2)
    tf.save_file({"q": packed}, path)
    with tf.safe_open(path) as f:
        assert f.info("q").dtype == "F4_E2M1FN"
        assert f.info("q").shape == (3, 8)  # logical elements
    out = tf.load_file(path, framework="pt")["q"]
    assert out.dtype == torch.float4_e2m1fn_x2 and tuple(out.shape) == (3, 4)
    assert torch.equal(out.view(torch.uint8), packed.view(torch.uint8))


def test_non_contiguous_and_numpy_interop(path):
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()
    tf.save_file({"x": x}, path)
    assert np.array_equal(tf.load_file(path)["x"], x.numpy())
    # A host view crosses into torch by DLPack without a copy, via numpy.
    with tf.Reader(path) as r:
        host = tf.Loader().load_to_host(r)["x"]
        t = torch.from_dlpack(host)
        assert torch.equal(t, x.contiguous())


def test_state_dict_and_scaling_state(path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4))
    state = {
        "0": {"recipe": {"type": "DelayedScaling", "amax_history_len": 4},
              "states": [{"direction": "forward", "slot_roles": ["input", "weight", "output"],
                          "scale": torch.tensor([1.0, 2.0, 3.0]),
                          "amax_history": torch.rand(4, 3)}]},
    }
    tft.save_state_dict(model, path, scaling_state=state, metadata={"step": "5"})
    other = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.LayerNorm(4))
    sd = tft.load_state_dict(path, device="cpu", module=other)
    for k, v in model.state_dict().items():
        assert torch.equal(sd[k], v) and torch.equal(other.state_dict()[k], v)
    got = tft.load_scaling_state(path, device="cpu")
    st = got["0"]["states"][0]
    assert got["0"]["recipe"]["amax_history_len"] == 4
    assert torch.equal(st["scale"], state["0"]["states"][0]["scale"])
    assert torch.equal(st["amax_history"], state["0"]["states"][0]["amax_history"])
    assert tf.read_metadata(path) == {"step": "5"}


def test_extra_state_is_never_pickled(path):
    sd = {"w": torch.ones(2), "layer._extra_state": torch.tensor([1, 2], dtype=torch.uint8)}
    with pytest.raises(TypeError, match="_extra_state"):
        tft.save_state_dict(sd, path)
    tft.save_state_dict(sd, path, extra_state="skip")
    assert list(tf.load_file(path)) == ["w"]


def test_save_state_dict_flattens_a_nested_state_as_convert_does(tmp_path):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.25)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 10}
    tft.save_state_dict(state, str(tmp_path / "saved.ferry"))
    torch.save(state, str(tmp_path / "saved.pt"))
    tf.convert(str(tmp_path / "saved.pt"), str(tmp_path / "converted.ferry"))
    saved = tft.load_state_dict(str(tmp_path / "saved.ferry"), device="cpu")
    converted = tft.load_state_dict(str(tmp_path / "converted.ferry"), device="cpu")
    assert sorted(saved) == sorted(converted)
    assert {"model.weight", "optimizer.state.0.exp_avg", "optimizer.state.1.exp_avg_sq"} <= \
        set(saved)
    for k in saved:
        assert torch.equal(saved[k], converted[k]), k
    typed = tf.read_metadata(str(tmp_path / "saved.ferry"), typed=True)
    assert typed == tf.read_metadata(str(tmp_path / "converted.ferry"), typed=True)
    assert typed["step"] == 10 and typed["optimizer.param_groups.0.lr"] == 0.25
    assert typed["optimizer.param_groups.0.params"] == [0, 1]


def test_following_the_skip_hint_never_writes_an_empty_checkpoint(tmp_path):
    path = str(tmp_path / "m.ferry")
    with pytest.raises(TypeError, match="extra_state='skip'"):
        tft.save_state_dict({"opaque": object()}, path)
    with pytest.raises(ValueError, match="nothing of the state would be stored"):
        with pytest.warns(UserWarning, match="left out"):
            tft.save_state_dict({"opaque": object()}, path, extra_state="skip")
    assert not (tmp_path / "m.ferry").exists()


def test_cpu_loads_are_views_and_take_verify_and_threads(tmp_path):
    path = str(tmp_path / "m.ferry")
    want = {"w": make(torch.bfloat16, (64, 33)), "i": make(torch.int32, (7,)),
            "f8": make(torch.float8_e4m3fn, (4, 4)), "e": torch.empty(0, 3)}
    tft.save_file(want, path)
    before = open(path, "rb").read()
    for got in (tft.load_file(path, device="cpu", threads=2),
                tft.load_file(path, device="cpu", verify=True),
                dict(tf.load_iter(path, device="cpu", framework="pt"))):
        assert sorted(got) == sorted(want)
        for k, v in want.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8),
                                                           v.view(torch.uint8)), k
            got[k].zero_()  # private: never reaches the file
    assert open(path, "rb").read() == before
    with tf.safe_open(path, framework="pt", device="cpu") as f:
        w = f.get_tensor("w")
        w.zero_()
        assert torch.equal(f.get_tensor("w"), want["w"])
        assert torch.equal(f.get_slice("w")[60:99], want["w"][60:])


def test_verify_refuses_a_corrupt_file_before_touching_the_model(tmp_path):
    path = str(tmp_path / "m.ferry")
    model = torch.nn.Linear(8, 4)
    tft.save_model(model, path)
    from test_host_loads import flip_byte

    with tf.Reader(path) as r:
        flip_byte(path, r.info("weight").data_offset + 3)
    other = torch.nn.Linear(8, 4)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(tf.DataLossError, match="'weight'"):
        tft.load_model(other, path, verify=True)
    for k, v in other.state_dict().items():
        assert torch.equal(v, before[k]), k
    with pytest.raises(tf.DataLossError, match="'weight'"):
        tft.load_file(path, verify=True)


# ---- CUDA ---------------------------------------------------------------------------------


@needs_cuda
def test_cuda_sources_and_current_device(path):
    x = make(torch.bfloat16, (64, 32), device="cuda")
    tf.save_file({"x": x, "f8": make(torch.float8_e4m3fn, (8, 8), device="cuda")}, path)
    out = tf.load_file(path, device="cuda")
    cur = torch.cuda.current_device()
    assert out["x"].device == torch.device("cuda", cur)
    same(out["x"], x)
    same(out["f8"], make(torch.float8_e4m3fn, (8, 8)))
    with tf.safe_open(path, framework="pt", device="cuda") as f:
        rows = f.get_slice("x")[10:20]
        assert rows.device == torch.device("cuda", cur)
        same(rows, x[10:20])


@needs_2_gpus
def test_current_device_1_not_0(path):
    x = make(torch.float32, (256, 256))
    tf.save_file({"x": x}, path)
    prev = torch.cuda.current_device()
    try:
        torch.cuda.set_device(1)
        out = tf.load_file(path, device="cuda")
        assert out["x"].device == torch.device("cuda", 1)
        sd = tft.load_state_dict(path)  # default device: the current one
        assert sd["x"].device == torch.device("cuda", 1)
        st = tft.load_scaling_state(path)
        assert st == {}
        same(out["x"], x)
        # An explicit device wins over the current one, and leaves the current one alone.
        out0 = tf.load_file(path, device="cuda:0")
        assert out0["x"].device == torch.device("cuda", 0)
        assert torch.cuda.current_device() == 1
    finally:
        torch.cuda.set_device(prev)


@needs_cuda
def test_stream_ordering_on_a_side_stream(path):
    n = 2 << 20  # 8 MiB: fits the staging ring, so no slot waits behind the sleep
    x = torch.arange(n, dtype=torch.int32)
    tf.save_file({"x": x}, path)
    side = torch.cuda.Stream()
    dst = torch.zeros(n, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    loader = tf.Loader()
    with tf.Reader(path) as r, torch.cuda.stream(side):
        # Keep the side stream busy so that the copies queue behind the sleep.
        torch.cuda._sleep(1_000_000_000)
        loader.load_into(r, [("x", None, dst, x.numel() * 4)], stream=side.cuda_stream,
                         non_blocking=True)
        # Enqueued, not waited for: the loader did not synchronize the stream or device.
        assert not side.query()
        result = dst.clone()  # ordered after the load on the same stream
        side.synchronize()
    assert torch.equal(result.cpu(), x)
    loader.close()


@needs_cuda
def test_load_file_on_side_stream(path):
    x = make(torch.float16, (512, 128))
    tf.save_file({"x": x}, path)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        out = tf.load_file(path, device="cuda")
        y = out["x"] * 2  # on the side stream, after the copies
    torch.cuda.synchronize()
    same(y.cpu(), (x * 2))


@needs_cuda
def test_dlpack_device_tensors(path):
    x = make(torch.float32, (32, 16))
    tf.save_file({"x": x}, path)
    with tf.Reader(path) as r:
        loader = tf.Loader()
        dev = loader.load(r)["x"]
        assert dev.__dlpack_device__() == (2, torch.cuda.current_device())
        t = torch.from_dlpack(dev)
        assert t.device == torch.device("cuda", torch.cuda.current_device())
        same(t, x)
        del t
        loader.close()


@needs_cuda
def test_load_iter_hands_over_each_tensor_complete(path):
    src = {"w%03d" % i: make(DTYPES[i % len(DTYPES)], (i % 5 + 1, 3)) for i in range(40)}
    src["scalar"] = make(torch.float32, ())
    src["empty"] = torch.zeros(0, 4)
    src["big"] = torch.randn(1024, 4096)  # several 4 MiB chunks
    tf.save_file(src, path)
    side = torch.cuda.Stream()
    seen = []
    with torch.cuda.stream(side):  # copies run on the current torch stream
        # Slow work first on that stream: a tensor handed over before its copy completed
        # would read back as the memset's zeros below instead of its bytes.
        scratch = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
        for _ in range(4):
            scratch.fill_(0)
        for name, t in tf.load_iter(path, device="cuda"):
            assert t.device.index == torch.cuda.current_device()
            # Read on another stream without waiting: the tensor must be complete.
            with torch.cuda.stream(torch.cuda.Stream()):
                host = t.to("cpu", non_blocking=False)
            same(host, src[name])
            seen.append(name)
    assert sorted(seen) == sorted(src)


@needs_cuda
def test_load_iter_errors_and_early_exit(path, tmp_path):
    tf.save_file({"a": torch.ones(3), "b": torch.zeros(2)}, path)
    it = tf.load_iter(path, device="cuda")
    name, t = next(it)
    assert name in ("a", "b")
    it.close()  # waits for the load, frees the reader
    with pytest.raises(tf.NotFoundError):
        next(tf.load_iter(str(tmp_path / "missing.ferry"), device="cuda"))


def _many(n=600):
    return {"t.%04d" % i: make(DTYPES[i % len(DTYPES)], (i % 5 + 1, 3)) for i in range(n)}


def test_many_tensors_cpu_views_exact(path):
    tensors = _many()
    tft.save_file(tensors, path)
    got = tft.load_file(path)
    assert got.keys() == tensors.keys()
    for k, v in tensors.items():
        same(got[k], v)
        assert got[k].is_contiguous()


def test_cpu_loads_verify_by_default(path):
    tensors = _many(300)
    tft.save_file(tensors, path)
    flip_data_byte(path, "t.0007", 1)
    for load in (lambda: tft.load_file(path), lambda: tft.load_state_dict(path, device="cpu"),
                 lambda: tf.load_file(path, framework="pt")):
        with pytest.raises(tf.DataLossError, match=r"tensor 't.0007': checksum mismatch"):
            load()
    assert tft.load_file(path, verify=False).keys() == tensors.keys()


@needs_cuda
def test_many_tensors_cuda_views_exact(path):
    tensors = _many()
    tft.save_file(tensors, path)
    got = tft.load_file(path, device="cuda")
    for k, v in tensors.items():
        same(got[k], v)
        assert got[k].is_cuda and got[k].is_contiguous()


@needs_cuda
def test_cuda_loads_verify_by_default(path):
    tensors = _many(300)
    tft.save_file(tensors, path)
    flip_data_byte(path, "t.0007", 1)
    with pytest.raises(tf.DataLossError, match=r"tensor 't.0007': checksum mismatch"):
        tft.load_file(path, device="cuda")
    with pytest.raises(tf.DataLossError, match=r"tensor 't.0007'"):
        for name, _ in tf.load_iter(path):
            assert name != "t.0007"  # never handed over
    with tf.safe_open(path, "pt", device="cuda") as f:
        with pytest.raises(tf.DataLossError, match=r"tensor 't.0007'"):
            f.get_tensor("t.0007")
    assert tft.load_file(path, device="cuda", verify=False).keys() == tensors.keys()
