"""DLPack export to every consumer: numpy, jax, torch, cupy. No consumer write may fault or reach
the file (views are private copy-on-write mappings), a consumer that refuses a tensor keeps its
own exception and the tensor is freed, and host loads and views import everywhere. GPU consumers
run where a CUDA device is present (tests/device/16_python.sh); the others need none."""

import gc
import os
import subprocess
import sys

import numpy as np
import pytest

import tensorferry as tf

ml_dtypes = pytest.importorskip("ml_dtypes")


@pytest.fixture
def ckpt(tmp_path):
    arrays = {
        "f32": np.arange(4096, dtype=np.float32).reshape(64, 64),
        "i8": np.arange(-50, 50, dtype=np.int8),
        "bf16": np.linspace(-2, 2, 512).astype(ml_dtypes.bfloat16).reshape(16, 32),
        "f16": np.arange(12, dtype=np.float16).reshape(3, 4),
    }
    path = str(tmp_path / "m.ferry")
    tf.save_file(arrays, path)
    return path, arrays


def file_mappings(path):
    real = os.path.realpath(path)
    return sum(1 for line in open("/proc/self/maps") if line.rstrip().endswith(" " + real))


def test_consumer_writes_never_fault_or_reach_the_file(ckpt):
    # What torch does with a view (it ignores the read-only flag): write through the pointer.
    # Run in a child: on a regression the write faults and must not take pytest down.
    path, arrays = ckpt
    before = open(path, "rb").read()
    code = (
        "import ctypes, sys, tensorferry as tf\n"
        "r = tf.Reader(sys.argv[1])\n"
        "t = r.view('f32')\n"
        "ctypes.memset(t.data_ptr, 0x7f, 64 * 64 * 4)\n"
        "print('wrote')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", code, path], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout
    assert open(path, "rb").read() == before


def test_numpy_views_and_host_loads(ckpt):
    path, arrays = ckpt
    before = open(path, "rb").read()
    with tf.Reader(path) as r:
        for name in ("f32", "i8", "f16"):
            a = np.from_dlpack(r.view(name))
            np.testing.assert_array_equal(a, arrays[name])
            assert a.flags.writeable
            a[...] = 0
            np.testing.assert_array_equal(np.from_dlpack(r.view(name)), arrays[name])
        loader = tf.Loader(threads=2)
        host = loader.load_to_host(r)
        for name in ("f32", "i8", "f16"):
            np.testing.assert_array_equal(np.from_dlpack(host[name]), arrays[name])
        loader.close()
    assert open(path, "rb").read() == before


def test_numpy_refusing_bf16_keeps_its_error_and_frees_the_tensor(ckpt, capfd):
    # numpy has no bfloat16: it refuses the capsule. Its own exception must come through (not
    # SystemError), and the refused tensor (with its mapping of the file) must be freed.
    path, _ = ckpt
    with tf.Reader(path) as r:
        gc.collect()
        base = file_mappings(path)
        for _ in range(3):
            with pytest.raises((BufferError, RuntimeError, TypeError)) as e:
                np.from_dlpack(r.view("bf16"))
            assert not isinstance(e.value, SystemError)
        gc.collect()
        assert file_mappings(path) == base
        # Legacy capsule path, refused the same way.
        t = r.view("bf16")
        cap = t.__dlpack__()
        del cap, t
        gc.collect()
        assert file_mappings(path) == base
    err = capfd.readouterr().err
    assert "Exception ignored" not in err and "SystemError" not in err


def test_views_are_freed_with_their_consumer(ckpt):
    path, _ = ckpt
    with tf.Reader(path) as r:
        gc.collect()
        base = file_mappings(path)
        arrays = [np.from_dlpack(r.view("f32")) for _ in range(4)]
        assert file_mappings(path) == base + 4
        del arrays
        gc.collect()
        assert file_mappings(path) == base


def test_jax_views_and_host_loads(ckpt):
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    path, arrays = ckpt
    with tf.Reader(path) as r:
        for name in arrays:
            x = jnp.from_dlpack(r.view(name))
            assert x.dtype == arrays[name].dtype
            np.testing.assert_array_equal(np.asarray(x), arrays[name])
            assert list(x.devices())[0].platform == "cpu"
        loader = tf.Loader(threads=2)
        host = loader.load_to_host(r)
        for name in arrays:
            np.testing.assert_array_equal(np.asarray(jnp.from_dlpack(host[name])), arrays[name])
        loader.close()
    del jax


def test_torch_views_and_host_loads(ckpt):
    torch = pytest.importorskip("torch")
    path, arrays = ckpt
    before = open(path, "rb").read()
    with tf.Reader(path) as r:
        t = torch.from_dlpack(r.view("f32"))
        t.add_(1)  # torch ignores read-only flags: this used to be a segmentation fault
        assert torch.equal(t, torch.from_numpy(arrays["f32"]) + 1)
        assert torch.equal(torch.from_dlpack(r.view("f32")), torch.from_numpy(arrays["f32"]))
        b = torch.from_dlpack(r.view("bf16"))
        assert b.dtype == torch.bfloat16
        assert torch.equal(b.view(torch.int16),
                           torch.from_numpy(arrays["bf16"].view(np.int16)))
        loader = tf.Loader(threads=2)
        host = loader.load_to_host(r)
        h = torch.from_dlpack(host["i8"])
        assert torch.equal(h, torch.from_numpy(arrays["i8"]))
        loader.close()
    assert open(path, "rb").read() == before


# ---- device consumers (skipped without a CUDA device) -------------------------------------


def _cuda_or_skip():
    if not tf.cuda_available():
        pytest.skip("no CUDA device")


def _device_tensors(path, names):
    loader = tf.Loader()
    with tf.Reader(path) as r:
        out = loader.load(r, names)
    return loader, out


def test_torch_cuda_consumer(ckpt):
    _cuda_or_skip()
    torch = pytest.importorskip("torch")
    path, arrays = ckpt
    loader, out = _device_tensors(path, ["f32", "bf16"])
    t = torch.from_dlpack(out["f32"])
    assert t.is_cuda and t.device.index == torch.cuda.current_device()
    assert torch.equal(t.cpu(), torch.from_numpy(arrays["f32"]))
    t.mul_(2)
    b = torch.from_dlpack(out["bf16"])
    assert b.dtype == torch.bfloat16 and b.is_cuda
    torch.cuda.synchronize()
    del t, b
    loader.close()


def test_cupy_cuda_consumer(ckpt):
    _cuda_or_skip()
    cupy = pytest.importorskip("cupy")
    path, arrays = ckpt
    loader, out = _device_tensors(path, ["f32", "i8"])
    x = cupy.from_dlpack(out["f32"])
    np.testing.assert_array_equal(cupy.asnumpy(x), arrays["f32"])
    x += 1
    np.testing.assert_array_equal(cupy.asnumpy(cupy.from_dlpack(out["i8"])), arrays["i8"])
    del x
    loader.close()


def test_jax_cuda_consumer(ckpt):
    _cuda_or_skip()
    jax = pytest.importorskip("jax")
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        pytest.skip("jax has no GPU backend here")
    import jax.numpy as jnp

    path, arrays = ckpt
    loader, out = _device_tensors(path, ["f32", "bf16"])
    x = jnp.from_dlpack(out["f32"])
    assert list(x.devices())[0].platform == "gpu"
    np.testing.assert_array_equal(np.asarray(x), arrays["f32"])
    b = jnp.from_dlpack(out["bf16"])
    assert b.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(b).view(np.int16), arrays["bf16"].view(np.int16))
    loader.close()
