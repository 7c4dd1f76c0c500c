"""What runs inside each measured child process (run_compare.py starts one per run).

A child gets a JSON spec on its command line and talks to the parent on stdin/stdout:
  "@@READY"           imports done and, for GPU runs, the CUDA context exists on the target
                      device (the last GPU): the parent samples memory, drops the page cache
                      for cold runs, then answers with a line
  "@@RESULT {json}"   the timed part: seconds, time to first tensor, verification
  "@@HOLD"            the loaded tensors are still alive: the parent asks NVML about this
                      process on every GPU, then answers with a line and the child exits
Anything else a library prints goes to stderr (stdout is redirected there during the run).
"""

import json
import os
import sys
import time

import ckpt

_PROTO = None  # the real stdout; sys.stdout points at stderr while libraries run


def _say(line):
    _PROTO.write(line + "\n")
    _PROTO.flush()


def _wait():
    if not sys.stdin.readline():
        sys.exit(0)


def main(spec):
    global _PROTO
    _PROTO = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # library chatter on fd 1 goes to stderr
    sys.stdout = sys.stderr
    role = spec["role"]
    try:
        if role == "generate":
            result = generate(spec)
            _say("@@RESULT " + json.dumps(result))
            return 0
        if role == "probe":
            _say("@@RESULT " + json.dumps(probe(spec)))
            return 0
        run = RUNNERS[spec["loader_kind"]]
        result = run(spec)
    except Exception as e:  # reported as the run's status, with the traceback on stderr
        import traceback

        traceback.print_exc()
        _say("@@RESULT " + json.dumps({"error": "%s: %s" % (type(e).__name__, e)}))
        return 1
    return 0 if result is None else result


# ---- probe ----------------------------------------------------------------------------------

PEERS = {
    "fastsafetensors": "fastsafetensors",
    "instanttensor": "instanttensor",
    "runai_model_streamer": "runai-model-streamer",
}


def probe(spec):
    """Versions, CUDA and which peers import, in a child so the parent holds no CUDA state."""
    from importlib import metadata

    out = {"python": sys.version.split()[0], "versions": {}, "peers": {}, "torch": None,
           "cuda": False, "gpus": 0, "ml_dtypes": False}
    for dist in ("torch", "safetensors", "numpy", "ml_dtypes", "matplotlib", "nvidia-ml-py",
                 "fastsafetensors", "instanttensor", "runai-model-streamer", "humanize",
                 "typer", "psutil"):
        try:
            out["versions"][dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    try:
        import ml_dtypes  # noqa: F401

        out["ml_dtypes"] = True
    except ImportError:
        pass
    try:
        import torch

        out["torch"] = torch.__version__
        out["cuda"] = bool(torch.cuda.is_available())
        out["gpus"] = torch.cuda.device_count() if out["cuda"] else 0
        out["torch_cuda"] = torch.version.cuda
    except Exception as e:
        out["torch_error"] = "%s: %s" % (type(e).__name__, e)
    if out["cuda"]:
        out["cudart"] = _find_cudart()
    for module in PEERS:
        try:
            __import__(module)
            out["peers"][module] = "ok"
        except Exception as e:
            out["peers"][module] = "%s: %s" % (type(e).__name__, e)
    try:
        import tensorferry

        out["tensorferry"] = tensorferry.version()
        out["tensorferry_library"] = tensorferry.library_path()
        out["tensorferry_cuda"] = bool(tensorferry.cuda_available()) if out["cuda"] else False
        import ctypes

        from tensorferry import _lib

        opts = _lib.LoaderOptions()
        _lib.lib().ferry_loader_options_init(ctypes.byref(opts))
        out["tensorferry_staging_bytes"] = opts.staging_bytes
    except Exception as e:
        out["tensorferry_error"] = "%s: %s" % (type(e).__name__, e)
    return out


def _find_cudart():
    """fastsafetensors dlopens "libcudart.so" (no version). torch's wheels ship only
    libcudart.so.<major>: returns "" when the plain name loads, else a file it can link to."""
    import ctypes
    import glob

    try:
        ctypes.CDLL("libcudart.so")
        return ""
    except OSError:
        pass
    import torch

    site = os.path.dirname(os.path.dirname(torch.__file__))
    cands = sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libcudart.so.*")) +
                   glob.glob(os.path.join(site, "nvidia", "cuda_runtime", "lib",
                                          "libcudart.so.*")) +
                   glob.glob("/usr/local/cuda/lib64/libcudart.so.*"))
    return cands[0] if cands else "none"


# ---- generation -----------------------------------------------------------------------------


def _host_bytes(t):
    """Raw bytes of a host tensor (numpy array or CPU torch tensor) as a numpy uint8 array."""
    import numpy as np

    if hasattr(t, "numpy") and hasattr(t, "view") and not isinstance(t, np.ndarray):
        import torch

        return t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return np.ascontiguousarray(t).reshape(-1).view(np.uint8)


def generate(spec):
    """Generates the checkpoint and writes it in every format the spec asks for."""
    data_dir = spec["data_dir"]
    seed, size_gib = spec["seed"], spec["size_gib"]
    backend = spec["backend"]
    specs, modules, config = ckpt.layout(size_gib)
    sspecs = ckpt.state_specs(modules, len(specs))
    samples = ckpt.sample_names(specs, modules)
    t0 = time.perf_counter()
    tensors = {}
    if backend == "torch":
        import torch

        dev = spec["device"]
        torch.cuda.set_device(dev)
        for s in specs + sspecs:
            tensors[s.name] = ckpt.make_torch(s, seed, torch.device("cuda", dev)).cpu()
        torch.cuda.synchronize()
    else:
        for s in specs + sspecs:
            tensors[s.name] = ckpt.make_numpy(s, seed)
    gen_s = time.perf_counter() - t0
    checksums = {n: str(ckpt.wsum(_host_bytes(tensors[n]))) for n in samples}
    base = {s.name: tensors[s.name] for s in specs}
    state = ckpt.scaling_state_from(tensors, modules)
    files = {}
    for fmt in spec["formats"]:
        path = os.path.join(data_dir, FORMAT_FILES[fmt])
        t0 = time.perf_counter()
        names = write_format(fmt, path, backend, base, tensors, state)
        if names is None:
            continue
        write_s = time.perf_counter() - t0
        nbytes = sum(_host_bytes(tensors[n]).size for n in names)
        files[fmt] = {"path": path, "file_bytes": os.path.getsize(path), "tensor_bytes": nbytes,
                      "tensors": len(names), "write_s": write_s}
        print("wrote %s: %.2f GB in %.1f s" % (path, files[fmt]["file_bytes"] / 1e9, write_s),
              file=sys.stderr)
    t0 = time.perf_counter()
    os.sync()
    sync_s = time.perf_counter() - t0
    manifest = {"seed": seed, "size_gib": size_gib, "backend": backend, "config": config,
                "specs": [s.to_json() for s in specs], "state_specs": [s.to_json() for s in sspecs],
                "modules": modules, "samples": samples, "checksums": checksums, "files": files,
                "generate_s": gen_s, "sync_s": sync_s}
    with open(os.path.join(data_dir, "manifest.json.tmp"), "w") as f:
        json.dump(manifest, f)
    os.replace(os.path.join(data_dir, "manifest.json.tmp"), os.path.join(data_dir, "manifest.json"))
    return {"files": files, "generate_s": gen_s, "sync_s": sync_s}


FORMAT_FILES = {"ferry-raw": "ckpt.ferry", "ferry-zstd": "ckpt-zstd.ferry",
                "ferry-planes": "ckpt-planes.ferry",
                "safetensors": "ckpt.safetensors", "pt": "ckpt.pt"}


def write_format(fmt, path, backend, base, tensors, state):
    """Writes one format; returns the tensor names it holds (None: not writable here)."""
    if fmt in ("ferry-raw", "ferry-zstd", "ferry-planes"):
        encoding = {"ferry-raw": "raw", "ferry-zstd": "shuffle_zstd",
                    "ferry-planes": "planes"}[fmt]
        meta = {"producer": "benchmarks/compare", "layout": "llama-like"}
        if backend == "torch":
            import tensorferry.torch as tft

            tft.save_state_dict(base, path, scaling_state=state, encoding=encoding,
                                metadata=meta)
        else:
            import tensorferry

            tensorferry.save_file(base, path, metadata=meta, encoding=encoding,
                                  scaling_state=state)
        return list(base)
    if fmt == "safetensors":
        if backend == "torch":
            import safetensors.torch

            safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
        else:
            import safetensors

            names = {"BF16": "bfloat16", "F8_E4M3FN": "float8_e4m3fn", "F32": "float32"}
            specs = {}
            for n, a in tensors.items():
                dt = _numpy_ferry_dtype(a)
                specs[n] = safetensors.TensorSpec(dtype=names[dt], shape=list(a.shape),
                                                  data_ptr=a.ctypes.data, data_len=a.nbytes)
            safetensors.serialize_file(specs, path, {"format": "np"})
        return list(tensors)
    if fmt == "pt":
        if backend != "torch":
            return None
        import torch

        torch.save(tensors, path)
        return list(tensors)
    raise ValueError(fmt)


def _numpy_ferry_dtype(a):
    import numpy as np

    for name in (ckpt.BF16, ckpt.FP8, ckpt.F32):
        if a.dtype == ckpt.numpy_dtype(name):
            return name
    raise TypeError("unexpected dtype %s" % np.dtype(a.dtype))


# ---- verification ---------------------------------------------------------------------------


def _manifest(spec):
    with open(spec["manifest"]) as f:
        return json.load(f)


def _expected_names(manifest, fmt):
    names = [s["name"] for s in manifest["specs"]]
    if not fmt.startswith("ferry"):
        names += [s["name"] for s in manifest["state_specs"]]
    return names


def _spec_objs(manifest):
    out = {}
    for d in manifest["specs"] + manifest["state_specs"]:
        s = ckpt.Spec(d["name"], d["dtype"], d["shape"], d["kind"], d["std"], d["amax"])
        s.index = d["index"]
        out[s.name] = s
    return out


def verify_torch(result, manifest, fmt, device, scaling_state=None):
    """Bit-exact check of the sample tensors against tensors regenerated on the GPU, plus
    names, shapes, dtypes and devices of all."""
    import torch

    specs = _spec_objs(manifest)
    expected = _expected_names(manifest, fmt)
    missing = [n for n in expected if n not in result]
    extra = [n for n in result if n not in specs]
    wrong_dev = [n for n, t in result.items()
                 if device is not None and (t.device.type != "cuda" or t.device.index != device)]
    wrong_meta = [n for n in expected if n in result and (
        tuple(result[n].shape) != specs[n].shape or
        result[n].dtype != ckpt.torch_dtype(specs[n].dtype))]
    mismatched = []
    checked = 0
    seed = manifest["seed"]
    gen_dev = torch.device("cuda", device) if device is not None else torch.device("cpu")
    for n in manifest["samples"]:
        if n not in specs:
            continue
        got = result.get(n)
        if got is None and scaling_state is not None:
            got = _state_tensor(scaling_state, n)
        if got is None:
            continue
        if manifest["backend"] == "torch":
            want = ckpt.make_torch(specs[n], seed, gen_dev)
        else:
            want = torch.from_numpy(ckpt.make_numpy(specs[n], seed).view("uint8")).view(
                ckpt.torch_dtype(specs[n].dtype)).reshape(specs[n].shape).to(gen_dev)
        checked += 1
        if not ckpt.torch_equal_bits(got.reshape(specs[n].shape), want):
            mismatched.append(n)
        del want
    return _verdict(checked, missing, extra, wrong_dev, wrong_meta, mismatched)


def _state_tensor(state, name):
    """The scale / amax_history of a loaded structured scaling state by its plain-tensor name."""
    if "._fp8_state." not in name:
        return None
    module, rest = name.split("._fp8_state.")
    direction, field = rest.split(".")
    entry = state.get(module)
    if entry is None:
        return None
    for st in entry["states"]:
        if st["direction"] == direction:
            return st[field]
    return None


def verify_numpy(result, manifest, fmt, scaling_state=None):
    specs = _spec_objs(manifest)
    expected = _expected_names(manifest, fmt)
    missing = [n for n in expected if n not in result]
    extra = [n for n in result if n not in specs]
    wrong_meta = []
    for n in expected:
        if n in result:
            a = result[n]
            if tuple(a.shape) != specs[n].shape or a.dtype.itemsize != ckpt.ITEMSIZE[specs[n].dtype]:
                wrong_meta.append(n)
    mismatched = []
    checked = 0
    for n in manifest["samples"]:
        got = result.get(n)
        if got is None and scaling_state is not None:
            got = _state_tensor(scaling_state, n)
        if got is None:
            continue
        checked += 1
        if not ckpt.numpy_equal_bits(got, ckpt.make_numpy(specs[n], manifest["seed"])):
            mismatched.append(n)
    return _verdict(checked, missing, extra, [], wrong_meta, mismatched)


def _verdict(checked, missing, extra, wrong_dev, wrong_meta, mismatched):
    ok = not (missing or extra or wrong_dev or wrong_meta or mismatched) and checked > 0
    out = {"ok": ok, "checked": checked}
    for key, v in (("missing", missing), ("extra", extra), ("wrong_device", wrong_dev),
                   ("wrong_shape_or_dtype", wrong_meta), ("mismatched", mismatched)):
        if v:
            out[key] = v[:5] + (["... %d in all" % len(v)] if len(v) > 5 else [])
    return out


# ---- GPU loaders ----------------------------------------------------------------------------


def _cuda_setup(spec):
    import numpy  # noqa: F401  (before the clock: tensorferry and peers import it lazily)
    import torch

    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        pass

    dev = spec.get("device")
    if dev is None:
        dev = torch.cuda.device_count() - 1
    torch.cuda.set_device(dev)
    torch.empty(1, device=torch.device("cuda", dev))  # the context, before the clock
    torch.cuda.synchronize()
    return torch, dev


class _Clock:
    def __init__(self, torch):
        self.torch = torch
        self.t0 = None
        self.first = None

    def start(self):
        self.t0 = time.perf_counter()

    def tensor(self):
        """Marks the first tensor as complete (synchronizing once)."""
        if self.first is None:
            if self.torch is not None:
                self.torch.cuda.synchronize()
            self.first = time.perf_counter() - self.t0


def _ferry_py(torch, dev, path, clock, spec):
    import tensorferry
    import tensorferry.torch as tft

    out = tensorferry.load_file(path, device="cuda")  # the current device
    state = tft.load_scaling_state(path)
    return out, {"scaling_state": state}


def _safetensors(torch, dev, path, clock, spec):
    import safetensors.torch

    return safetensors.torch.load_file(path, device="cuda:%d" % dev), {}


def _torch_mmap(torch, dev, path, clock, spec):
    sd = torch.load(path, mmap=True, weights_only=True)
    out = {}
    for k, v in sd.items():
        out[k] = v.to("cuda")
        clock.tensor()
    return out, {}


def _torch_map(torch, dev, path, clock, spec):
    return torch.load(path, map_location="cuda", weights_only=True), {}


def _fastsafetensors(torch, dev, path, clock, spec):
    from fastsafetensors import fastsafe_open

    f = fastsafe_open(path, framework="pt", device="cuda:%d" % dev, nogds=True)
    out = {}
    for k in f.keys():
        out[k] = f.get_tensor(k)
        clock.tensor()
    return out, {"cleanup": lambda: f.__exit__(None, None, None)}


def _instanttensor(torch, dev, path, clock, spec):
    from instanttensor import BackendPolicy, safe_open

    kwargs = {}
    if spec.get("variant") == "buffered":
        kwargs["backend"] = BackendPolicy.BUFFERED
    out = {}
    with safe_open(path, framework="pt", device=dev, **kwargs) as f:
        for name, t in f.tensors():
            out[name] = t
            clock.tensor()
    return out, {}


def _runai(torch, dev, path, clock, spec):
    from runai_model_streamer import SafetensorsStreamer

    out = {}
    with SafetensorsStreamer() as s:
        s.stream_file(path, device="cuda:%d" % dev)
        for name, t in s.get_tensors():
            out[name] = t
            clock.tensor()
    return out, {}


GPU_LOADERS = {
    "tensorferry-py": _ferry_py,
    "safetensors": _safetensors,
    "torch-mmap": _torch_mmap,
    "torch-map_location": _torch_map,
    "fastsafetensors": _fastsafetensors,
    "instanttensor": _instanttensor,
    "runai-streamer": _runai,
}


# Modules each loader needs, imported before the clock starts (imports are not load time).
PRELOAD = {
    "tensorferry-py": ["tensorferry", "tensorferry.torch"],
    "safetensors": ["safetensors.torch"],
    "fastsafetensors": ["fastsafetensors"],
    "instanttensor": ["instanttensor"],
    "runai-streamer": ["runai_model_streamer"],
}


def run_gpu_loader(spec):
    import importlib

    for k, v in spec.get("env", {}).items():
        os.environ[k] = v
    torch, dev = _cuda_setup(spec)
    for module in PRELOAD.get(spec["loader"], []):
        importlib.import_module(module)
    if spec["loader"].startswith("tensorferry"):
        import tensorferry

        tensorferry.version()  # dlopen libferry.so now, not inside the timed load
    fn = GPU_LOADERS[spec["loader"]]
    manifest = _manifest(spec)
    _say("@@READY")
    _wait()
    clock = _Clock(torch)
    clock.start()
    out, extra = fn(torch, dev, spec["path"], clock, spec)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - clock.t0
    result = {"seconds": seconds, "ttft": clock.first if clock.first is not None else seconds,
              "ttft_kind": "first" if clock.first is not None else "whole",
              "device": dev, "max_reserved_mib": torch.cuda.max_memory_reserved(dev) / 2**20}
    result["verify"] = verify_torch(out, manifest, spec["format"], dev,
                                    extra.get("scaling_state"))
    _say("@@RESULT " + json.dumps(result))
    _say("@@HOLD")
    _wait()
    if extra.get("cleanup"):
        extra["cleanup"]()
    return None


# ---- host loaders (no CUDA) -----------------------------------------------------------------


def run_host_loader(spec):
    loader = spec["loader"]
    manifest = _manifest(spec)
    path = spec["path"]
    torch = None
    import numpy  # noqa: F401  (imported before the clock, as torch is for GPU runs)
    try:
        import ml_dtypes  # noqa: F401  (numpy's bfloat16 / float8 types)
    except ImportError:
        pass
    if loader in ("torch-host", "safetensors-host") and spec.get("torch"):
        import torch
    if loader == "tensorferry-py-host":
        import tensorferry

        tensorferry.version()  # dlopen libferry.so before the clock
    elif loader == "safetensors-host":
        import safetensors
        if torch is not None:
            import safetensors.torch
    _say("@@READY")
    _wait()
    clock = _Clock(None)
    clock.start()
    state = None
    if loader == "tensorferry-py-host":
        out = tensorferry.load_file(path)
        state = tensorferry.read_scaling_state(path)
    elif loader == "safetensors-host":
        if torch is not None:
            out = safetensors.torch.load_file(path)
        else:
            # safetensors.numpy knows neither bfloat16 nor float8: the library's own parser,
            # with ml_dtypes for the element types.
            np_types = {"BF16": ckpt.numpy_dtype(ckpt.BF16), "F8_E4M3": ckpt.numpy_dtype(ckpt.FP8),
                        "F32": ckpt.numpy_dtype(ckpt.F32)}
            with open(path, "rb") as f:
                data = f.read()
            out = {}
            for k, d in safetensors.deserialize(data):
                out[k] = numpy.frombuffer(d["data"], np_types[d["dtype"]]).reshape(d["shape"])
    elif loader == "torch-host":
        out = torch.load(path, weights_only=True)
    else:
        raise ValueError(loader)
    seconds = time.perf_counter() - clock.t0
    result = {"seconds": seconds, "ttft": clock.first if clock.first is not None else seconds,
              "ttft_kind": "first" if clock.first is not None else "whole", "device": -1}
    if torch is not None and out and hasattr(next(iter(out.values())), "device"):
        result["verify"] = verify_torch(out, manifest, spec["format"], None)
    else:
        result["verify"] = verify_numpy(out, manifest, spec["format"], state)
    _say("@@RESULT " + json.dumps(result))
    _say("@@HOLD")
    _wait()
    return None


# ---- ceilings -------------------------------------------------------------------------------


def run_pinned_h2d(spec):
    """Pinned host -> device copies of 256 MiB chunks, timed with CUDA events: the ceiling of
    any loader that ends in host-to-device DMA."""
    torch, dev = _cuda_setup(spec)
    _say("@@READY")
    _wait()
    chunk = 256 << 20
    slots = 4
    total = max(spec["bytes"], chunk * slots)
    n = -(-total // chunk)
    src = torch.empty(chunk * slots, dtype=torch.uint8, pin_memory=True)
    src.fill_(1)
    dst = torch.empty(chunk * slots, dtype=torch.uint8, device=torch.device("cuda", dev))
    for i in range(slots):  # warm-up
        dst[i * chunk:(i + 1) * chunk].copy_(src[i * chunk:(i + 1) * chunk], non_blocking=True)
    torch.cuda.synchronize()
    best = None
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(n):
            s = i % slots
            dst[s * chunk:(s + 1) * chunk].copy_(src[s * chunk:(s + 1) * chunk], non_blocking=True)
        end.record()
        end.synchronize()
        secs = start.elapsed_time(end) / 1e3
        best = secs if best is None else min(best, secs)
    moved = n * chunk
    # Reported over the checkpoint's bytes so the row reads like the loaders' rows.
    seconds = best * spec["bytes"] / moved
    _say("@@RESULT " + json.dumps({"seconds": seconds, "ttft": None, "ttft_kind": "",
                                   "device": dev, "pinned_bytes": chunk * slots,
                                   "chunk_bytes": chunk, "moved_bytes": moved}))
    _say("@@HOLD")
    _wait()
    return None


def run_file_read(spec):
    """Reads the whole file with several threads (O_DIRECT when cold and supported): the
    storage or page-cache ceiling of any loader of that file."""
    import mmap
    import threading

    path = spec["path"]
    direct = bool(spec.get("direct")) and hasattr(os, "O_DIRECT")
    threads = spec.get("threads") or min(16, os.cpu_count() or 1)
    block = 16 << 20
    size = os.path.getsize(path)
    bufs = [mmap.mmap(-1, block) for _ in range(threads)]
    _say("@@READY")
    _wait()
    t0 = time.perf_counter()
    used_direct = direct
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    except OSError:
        fd, used_direct = os.open(path, os.O_RDONLY), False
    errors = []
    counts = [0] * threads

    def work(k):
        try:
            off = k * block
            while off < size:
                got = os.preadv(fd, [bufs[k]], off)
                if got <= 0:
                    break
                counts[k] += got
                off += threads * block
        except OSError as e:
            errors.append(str(e))

    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    os.close(fd)
    seconds = time.perf_counter() - t0
    if errors:
        raise OSError(errors[0])
    if sum(counts) != size:
        raise OSError("read %d of %d bytes" % (sum(counts), size))
    _say("@@RESULT " + json.dumps({"seconds": seconds, "ttft": None, "ttft_kind": "",
                                   "device": -1, "threads": threads, "direct": used_direct,
                                   "bytes": size}))
    _say("@@HOLD")
    _wait()
    return None


RUNNERS = {
    "gpu": run_gpu_loader,
    "host": run_host_loader,
    "pinned-h2d": run_pinned_h2d,
    "file-read": run_file_read,
}


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
