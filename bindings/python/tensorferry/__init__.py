"""TensorFerry: device-agnostic tensor checkpoints that load onto the caller's current GPU.

    import tensorferry
    tensorferry.save_file({"w": array}, "model.ferry", metadata={"step": "10"})
    arrays = tensorferry.load_file("model.ferry")                   # numpy, on the host
    tensors = tensorferry.load_file("model.ferry", device="cuda")   # torch, current device
    with tensorferry.safe_open("model.ferry", framework="np") as f:
        w = f.get_tensor("w")                 # zero-copy, read-only view of the file
        shard = f.get_slice("w")[0:128]       # rows 0..127 only

Devices: ``"cuda"`` (or ``torch.device("cuda")``) is the current device,
``torch.cuda.current_device()``, never cuda:0; ``"cuda:N"`` names device N; ``"cpu"`` is host
memory. Copies to a GPU run on that device's current torch stream.

The package is pure Python over libferry.so through ctypes (see ``_lib`` for where the library
is looked up). Tensors cross by DLPack (``DLPackTensor``); FP8, FP6, FP4 and bfloat16 reach
numpy through ml_dtypes.
"""

# The package's version, equal to the library's (CMakeLists.txt: project VERSION); the wheel
# build reads it from here.
__version__ = "0.1.0"

import atexit
import ctypes
import operator
import os
import threading

from . import _dtypes, _lib, _scaling, _state
from ._dlpack import DLPackTensor, HostBuffer
from ._lib import (CudaError, DataLossError, FerryError, InternalError, InvalidArgumentError,
                   IoError, NotFoundError, ResourceExhaustedError, UnimplementedError,
                   load_library, library_path)
from ._convert import convert

__all__ = [
    "save_file", "save_file_async", "StagingPool", "SaveFuture", "load_file", "load_iter",
    "safe_open", "read_metadata", "read_scaling_state", "Reader", "Loader", "TensorInfo",
    "DLPackTensor", "cuda_available", "version", "load_library",
    "library_path", "FerryError", "InvalidArgumentError", "NotFoundError", "DataLossError",
    "ResourceExhaustedError", "UnimplementedError", "InternalError", "CudaError", "IoError",
    "convert",
]


def version():
    """The loaded library's version, "MAJOR.MINOR.PATCH"."""
    return _lib.lib().ferry_version().decode()


def cuda_available():
    """True when libferry was built with the CUDA loader and a device is usable."""
    return bool(_lib.lib().ferry_cuda_available())


def _path(p):
    b = os.fsencode(os.fspath(p))
    # The C library takes NUL-terminated strings: "a\0.bak" would silently become "a".
    if b"\0" in b:
        raise ValueError("tensorferry: path %r contains a NUL byte" % (p,))
    return b


_text = _lib.text


def _name(n):
    if not isinstance(n, str):
        raise TypeError("tensorferry: tensor names are str, got %r" % type(n).__name__)
    return _text(n, "tensor name")


class TensorInfo:
    """Description of a stored tensor: name, dtype (a ferry dtype name such as "BF16"),
    shape (logical element counts), nbytes (raw), encoding ("raw", "zstd", "shuffle+zstd",
    "planes")."""

    __slots__ = ("name", "dtype", "shape", "nbytes", "encoding", "data_offset", "data_size")

    def __init__(self, name, dtype, shape, nbytes, encoding, data_offset, data_size):
        self.name = name
        self.dtype = _dtypes.name(dtype)
        self.shape = shape
        self.nbytes = nbytes
        self.encoding = _lib.ENCODING_NAMES[encoding]
        self.data_offset = data_offset
        self.data_size = data_size

    def __repr__(self):
        return "TensorInfo(%r, %s, %r, %s)" % (self.name, self.dtype, self.shape, self.encoding)


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


# ---- writing ------------------------------------------------------------------------------


def _torch_source(t):
    """(dtype name, shape, contiguous tensor) of a torch tensor to save. A contiguous copy of a
    CUDA tensor is made on the current stream, before the copies that read it."""
    name = _dtypes.from_torch(t.dtype)
    shape = list(t.shape)
    if name == "F4_E2M1FN":  # float4_e2m1fn_x2: pairs along the last dimension
        shape = shape[:-1] + [shape[-1] * 2] if shape else [2]
    return name, shape, t if t.is_contiguous() else t.contiguous()


def _host_source(value):
    """(dtype name, shape, pointer, nbytes, keepalive) of a host copy of `value`."""
    import numpy as np

    if hasattr(value, "detach") and hasattr(value, "data_ptr"):  # torch.Tensor
        t = value.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")  # CUDA sources: copied to the host on the current stream
        name, shape, t = _torch_source(t)
        return name, shape, t.data_ptr(), t.numel() * t.element_size(), t
    if not isinstance(value, np.ndarray):
        if hasattr(value, "__dlpack__") and not hasattr(value, "__array_interface__"):
            value = np.from_dlpack(value)
        else:
            value = np.asarray(value)
    if not value.dtype.isnative:
        # Stored little-endian, as safetensors does: byte-swapped on the way out.
        value = value.astype(value.dtype.newbyteorder("="))
    name = _dtypes.from_numpy(value.dtype)
    shape = list(value.shape)
    if name == "F4_E2M1FN":
        arr = _dtypes.pack_fp4(value.view(np.uint8))
    else:
        arr = np.ascontiguousarray(value)
    return name, shape, arr.ctypes.data, arr.nbytes, arr


def _cuda_source(value):
    """(dtype name, shape, device pointer, nbytes, stream, keepalive) of a torch CUDA tensor on
    the current device, else None (other tensors go through _host_source)."""
    if not (hasattr(value, "detach") and hasattr(value, "data_ptr")):
        return None
    t = value.detach()
    if t.device.type != "cuda" or not cuda_available():
        return None
    import torch

    if t.device.index != torch.cuda.current_device():
        return None  # another device's tensor: copied through the host, as before
    stream = torch.cuda.current_stream(t.device)
    name, shape, t = _torch_source(t)
    return name, shape, t.data_ptr(), t.numel() * t.element_size(), stream.cuda_stream, t


def _add_source(handle, name, value, keep):
    """Adds one tensor to the writer; device sources stay referenced in `keep` until the
    snapshot is complete."""
    cuda = _cuda_source(value)
    if cuda is not None:
        dtype, shape, ptr, nbytes, stream, t = cuda
        cshape = (ctypes.c_int64 * max(1, len(shape)))(*shape)
        _lib.call("ferry_writer_add_device_tensor_async", handle, _name(name),
                  _dtypes.code(dtype), cshape, len(shape), ctypes.c_void_p(ptr), nbytes,
                  _lib.ENCODING_DEFAULT, ctypes.c_void_p(stream))
        keep.append(t)
        return
    dtype, shape, ptr, nbytes, host = _host_source(value)
    cshape = (ctypes.c_int64 * max(1, len(shape)))(*shape)
    _lib.call("ferry_writer_add_tensor", handle, _name(name), _dtypes.code(dtype), cshape,
              len(shape), ctypes.c_void_p(ptr), nbytes, _lib.ENCODING_DEFAULT)
    # With a staging pool the bytes were copied; without one they were written.
    del host


class StagingPool:
    """Host staging memory for saves, allocated once and reused by every save that names it
    (allocating and pinning costs ~0.25 s per GiB). A save whose tensors fit in the pool
    returns from ``save_file_async`` as soon as they are copied into it; with a smaller pool
    the call also waits for earlier blocks to be written to the file to free space. The memory
    is pinned for CUDA on first use with device tensors (or now, with ``pin=True``), in the
    current device's context. Thread-safe; several saves may share one pool. close() drops
    this reference; saves in progress keep the memory until they finish."""

    def __init__(self, nbytes, pin=False):
        handle = ctypes.c_void_p()
        _lib.call("ferry_staging_pool_create", int(nbytes), 1 if pin else 0, ctypes.byref(handle))
        self._handle = handle

    @property
    def nbytes(self):
        return _lib.lib().ferry_staging_pool_bytes(self._handle)

    def close(self):
        h, self._handle = getattr(self, "_handle", None), None
        if h is not None:
            _lib.lib().ferry_staging_pool_free(h)

    def __del__(self):
        self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class SaveFuture:
    """The rest of an asynchronous save (compression, writes, fsync, atomic rename) running in
    the background. done() polls; wait(timeout) blocks and returns done(); result(timeout)
    returns the path or raises the save's error (FerryError) or TimeoutError; exception()
    returns the error or None. The save finishes even if the future is dropped (the handle's
    release waits for it)."""

    def __init__(self, handle, path, progress=None):
        self._handle = handle
        self._path = path
        self._progress = progress  # kept alive: the library calls it until the save is done
        self._error = None
        self._finished = False
        self._lock = threading.Lock()

    def done(self):
        with self._lock:
            if self._finished or self._handle is None:
                return True
            return bool(_lib.lib().ferry_save_done(self._handle))

    def _finish(self):
        with self._lock:
            if self._finished:
                return
            try:
                _lib.call("ferry_save_wait", self._handle)
            except FerryError as e:
                failed = self._progress.error if self._progress is not None else None
                self._error = failed if failed is not None else e
            _lib.lib().ferry_save_free(self._handle)
            self._handle = None
            self._finished = True

    def wait(self, timeout=None):
        if timeout is None:
            self._finish()
            return True
        import time

        deadline = time.monotonic() + timeout
        while not self.done():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)
        self._finish()
        return True

    def exception(self, timeout=None):
        if not self.wait(timeout):
            raise TimeoutError("tensorferry: save of %r still running" % (self._path,))
        return self._error

    def result(self, timeout=None):
        error = self.exception(timeout)
        if error is not None:
            raise error
        return self._path

    def __del__(self):
        if getattr(self, "_handle", None) is not None:
            self._finish()


_shared_pools = {}
_shared_pools_lock = threading.Lock()


def _pool_for(nbytes):
    """A process-wide pool of at least `nbytes` (rounded up to 256 MiB), reused across saves."""
    need = max(64 << 20, (int(nbytes) + (256 << 20) - 1) // (256 << 20) * (256 << 20))
    with _shared_pools_lock:
        pool = _shared_pools.get("default")
        if pool is None or pool.nbytes < need:
            if pool is not None:
                pool.close()
            pool = StagingPool(need)
            _shared_pools["default"] = pool
        return pool


@atexit.register
def _free_shared_pools():
    # Pinned memory must go back while the CUDA context still exists.
    with _shared_pools_lock:
        pools = list(_shared_pools.values())
        _shared_pools.clear()
    for pool in pools:
        pool.close()


def _nbytes(value):
    if hasattr(value, "element_size") and hasattr(value, "numel"):
        return value.numel() * value.element_size()
    return getattr(value, "nbytes", 0)


def _staging_for(tensors, staging):
    """The StagingPool an asynchronous save of `tensors` uses: `staging` itself, a new pool of
    that many bytes, or (None) the process-wide one."""
    if staging is None:
        return _pool_for(sum(_nbytes(v) for v in tensors.values()))
    if not isinstance(staging, StagingPool):
        return StagingPool(int(staging))
    return staging


def save_file_async(tensors, path, metadata=None, *, encoding="raw", zstd_level=None,
                    block_size=None, threads=0, durable=True, scaling_state=None, producer=None,
                    staging=None, direct_io=True, progress=None):
    """As save_file, but returns a SaveFuture once every tensor is snapshotted into host memory:
    the caller may then overwrite or free its tensors (CUDA ones included) while compression,
    writes, fsync and the atomic rename finish in the background. A crash before the future
    completes leaves any previous file at `path` untouched.

    staging: a StagingPool (reused across saves) or a size in bytes; None uses a process-wide
    pool at least as large as `tensors` (allocated on first use, grown when a larger
    checkpoint comes). With a pool smaller than the checkpoint, the call also waits until all
    but the last pool-full of bytes are written to the file."""
    return save_file(tensors, path, metadata, encoding=encoding, zstd_level=zstd_level,
                     block_size=block_size, threads=threads, durable=durable,
                     scaling_state=scaling_state, producer=producer,
                     staging=_staging_for(tensors, staging), direct_io=direct_io,
                     progress=progress, _background=True)


def _is_torch(value):
    return type(value).__module__.startswith("torch") and hasattr(value, "untyped_storage")


def _byte_range(t):
    """[first, end) of the bytes a torch tensor covers in its storage."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    span = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (span + 1) * t.element_size()


def shared_tensor_groups(tensors):
    """Sets of names (two or more) of torch tensors in `tensors` whose bytes overlap in one
    storage, as safetensors finds them; sorted."""
    by_storage = {}
    for name, t in tensors.items():
        if not _is_torch(t) or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() == 0 or storage.nbytes() == 0:
            continue
        by_storage.setdefault((str(t.device), storage.data_ptr()), []).append(name)
    groups = []
    for names in by_storage.values():
        if len(names) < 2:
            continue
        areas = sorted(_byte_range(tensors[n]) + (n,) for n in names)
        group, end = {areas[0][2]}, areas[0][1]
        for start, stop, n in areas[1:]:
            if start >= end:
                if len(group) > 1:
                    groups.append(group)
                group = {n}
            else:
                group.add(n)
            end = max(end, stop)
        if len(group) > 1:
            groups.append(group)
    return sorted(groups, key=sorted)


class _Progress:
    """A save's progress callable for the library: called with the tensor bytes written so far
    after each block, from a writer thread. An exception it raises stops the save, and is
    raised in place of the library's error."""

    def __init__(self, fn):
        self.error = None

        def call(_user, written):
            try:
                fn(int(written))
                return 0
            except BaseException as e:  # noqa: B902 - any exception stops the save
                self.error = e
                return 1

        self.c_function = _lib.PROGRESS_FN(call)


def _refuse_shared(tensors):
    shared = shared_tensor_groups(tensors)
    if shared:
        # Stored twice, they would load as independent tensors (as safetensors refuses them).
        raise RuntimeError(
            "tensorferry: some tensors share memory, which would store their bytes twice and "
            "load them as separate tensors: %s. Save one of each group (or .clone() the "
            "others), or use tensorferry.torch.save_model, which drops the duplicate names."
            % ", ".join("{%s}" % ", ".join(repr(n) for n in sorted(g)) for g in shared))


def _fill_writer(handle, tensors, metadata, scaling_state, keep):
    """Adds tensors, metadata and scaling state to a C writer handle; device sources stay
    referenced in `keep` until the snapshot is complete."""
    for name, value in tensors.items():
        _add_source(handle, name, value, keep)
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError("tensorferry: metadata keys and values must be str (got %r: %r)"
                            % (key, value))
        _lib.call("ferry_writer_set_metadata", handle, _text(key, "metadata key"),
                  _text(value, "metadata value"))
    if scaling_state:
        _scaling.add_to_writer(handle, scaling_state)


def save_file(tensors, path, metadata=None, *, encoding="raw", zstd_level=None, block_size=None,
              threads=0, durable=True, scaling_state=None, producer=None, min_savings=None,
              staging=None, direct_io=True, progress=None, _background=False):
    """Writes `tensors` (a dict of name -> numpy array or torch tensor, CPU or CUDA) to `path`.

    The file appears atomically at commit: a failure leaves any previous file untouched.
    torch tensors that share memory are refused (RuntimeError naming them), as safetensors
    does; non-contiguous tensors are stored contiguously (safetensors refuses them).
    encoding: "raw" (zero-copy views on load), "zstd" or "shuffle+zstd" (also spelled
    "shuffle_zstd"; bf16/f16/f32 weights compress best), or "planes" (bf16/f16 weights about
    1.47x smaller, expanded on the GPU while loading, so hot loads move fewer bytes over the
    link); zstd_level None keeps the library's default. metadata: dict of str -> str.
    min_savings: a block is stored uncompressed unless zstd saves this fraction (None: the
    library's 0.03).
    scaling_state: FP8 scaling state in the structured form of tensorferry._scaling (stored as
    data, never pickled).
    progress: a callable given the tensor bytes written so far after each block (from a writer
    thread, one call at a time); an exception it raises stops the save, leaves any previous
    file at `path` as it was, and is raised here (or by the future's result()).

    CUDA tensors on the current device are read in place: device-to-host copies into pinned
    staging memory on torch's current stream, overlapped with compression and writes (other
    devices' tensors are copied to the host first). The tensors may be reused once save_file
    returns. staging: an optional StagingPool that every tensor is first copied into (see
    save_file_async). direct_io: write through O_DIRECT where the file system supports it
    (faster on the disks measured; the saved file is then not left in the page cache).
    """
    _lib.encoding_code(encoding)  # a bad name is refused before anything else is looked at
    _refuse_shared(tensors)
    opts = _lib.writer_options(encoding, zstd_level, threads, durable, block_size, min_savings,
                               producer)
    L = _lib.lib()
    opts.staging = staging._handle if staging is not None else None
    opts.direct_io = 1 if direct_io else 0
    reporter = _Progress(progress) if progress is not None else None
    if reporter is not None:
        opts.progress = reporter.c_function
    handle = ctypes.c_void_p()
    _lib.call("ferry_writer_create", _path(path), ctypes.byref(opts), ctypes.byref(handle))
    keep = []  # CUDA sources (and their contiguous copies) until the snapshot is complete
    try:
        _fill_writer(handle, tensors, metadata, scaling_state, keep)
        if _background:
            save = ctypes.c_void_p()
            _lib.call("ferry_writer_commit_async", handle, ctypes.byref(save))
            return SaveFuture(save, path, reporter)
        _lib.call("ferry_writer_commit", handle)
    except FerryError:
        if reporter is not None and reporter.error is not None:
            raise reporter.error
        raise
    finally:
        L.ferry_writer_free(handle)
        del keep


# ---- reading ------------------------------------------------------------------------------



class _Closable:
    """A library handle freed by close(), by `with`, or when garbage collected."""

    def __del__(self):
        if getattr(self, "_handle", None) is not None:
            self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

_STORAGE_OPTIONS = ("ca_bundle", "max_attempts", "max_in_flight", "piece_bytes")


def _reader_options(verify=False, storage_options=None):
    """The C reader options: `storage_options` (a dict) sets how http(s):// and s3:// paths
    are read, over the defaults and the environment (AWS_* variables, AWS_CA_BUNDLE,
    CURL_CA_BUNDLE, SSL_CERT_FILE): ca_bundle (a PEM file), max_attempts, max_in_flight,
    piece_bytes."""
    opts = _lib.ReaderOptions()
    _lib.lib().ferry_reader_options_init(ctypes.byref(opts))
    opts.verify_on_open = 1 if verify else 0
    for key, value in (storage_options or {}).items():
        if key not in _STORAGE_OPTIONS:
            raise TypeError("tensorferry: unknown storage option %r (known: %s)"
                            % (key, ", ".join(_STORAGE_OPTIONS)))
        if key == "ca_bundle":
            value = _path(value)
        elif not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError("tensorferry: storage option %s must be a non-negative int, got %r"
                             % (key, value))
        setattr(opts, key, value)
    return opts


class Reader(_Closable):
    """An open checkpoint (the C reader handle): a local path, or an http(s):// or s3:// URL
    (a str). Thread-safe; views it hands out stay valid after close()."""

    def __init__(self, path, verify=False, *, storage_options=None, _handle=None):
        import numpy as np

        L = _lib.lib()
        handle = _handle
        if handle is None:
            opts = _reader_options(verify, storage_options)
            handle = ctypes.c_void_p()
            try:
                _lib.call("ferry_reader_open", _path(path), ctypes.byref(opts),
                          ctypes.byref(handle))
            except NotFoundError as e:
                # Opening reports NotFound only for the file itself: Python's type for that.
                raise _lib.MissingFileError(e.code, str(e), os.fspath(path)) from None
        self._handle = handle
        self._lib = L
        try:
            # Every description in one call, copied out as three byte strings: names are
            # split in one pass, TensorInfo objects are made on first use.
            table = _lib.TensorTable()
            table.struct_size = ctypes.sizeof(table)
            _lib.call("ferry_reader_tensor_table", handle, ctypes.byref(table))
            n = table.num_tensors
            names = ctypes.string_at(table.names, table.names_size) if n else b""
            try:
                self._order = names.decode("utf-8").split("\0")[:-1]
            except UnicodeDecodeError:
                for i, raw in enumerate(names.split(b"\0")[:-1]):  # which one, for the message
                    _lib.decode(raw, path, "tensor #%d name" % i)
                raise
            self._table = np.frombuffer(
                ctypes.string_at(table.records, n * table.record_size) if n else b"",
                dtype=_lib.record_dtype(table.record_size), count=n)
            self._dims = np.frombuffer(
                ctypes.string_at(table.shapes, 8 * table.num_shape_entries)
                if table.num_shape_entries else b"", "<i8")
            self._packed_bytes = table.packed_bytes
        except BaseException:
            self.close()
            raise
        self._infos = {}
        self._index = None
        self._columns = None

    @property
    def handle(self):
        if self._handle is None:
            raise ValueError("tensorferry: the checkpoint is closed")
        return self._handle

    @property
    def closed(self):
        return self._handle is None

    def close(self):
        h, self._handle = self._handle, None
        if h is not None:
            self._lib.ferry_reader_free(h)


    @property
    def path(self):
        return self._lib.ferry_reader_path(self.handle).decode("utf-8", "surrogateescape")

    @property
    def producer(self):
        return _lib.decode(self._lib.ferry_reader_producer(self.handle), self.path, "producer")

    def keys(self):
        self.handle  # raises once closed, like every other call
        return list(self._order)

    def _index_of(self, name):
        index = self._index
        if index is None:
            index = self._index = dict(zip(self._order, range(len(self._order))))
        return index.get(name)

    def _record(self, i):
        """(name, dtype code, shape, nbytes, encoding code, data_offset, data_size,
        packed_offset) of tensor i in name order."""
        c = self._columns
        if c is None:  # Python lists, once: a record is read per tensor in the load loops
            c = self._columns = {f: self._table[f].tolist() for f in (
                "shape_offset", "nbytes", "data_offset", "data_size", "packed_offset", "dtype",
                "ndim", "encoding")}
            c["dims"] = self._dims.tolist()
        at, ndim = c["shape_offset"][i], c["ndim"][i]
        return (self._order[i], c["dtype"][i], tuple(c["dims"][at:at + ndim]),
                c["nbytes"][i], c["encoding"][i], c["data_offset"][i], c["data_size"][i],
                c["packed_offset"][i])

    def info(self, name):
        self.handle
        info = self._infos.get(name)
        if info is None:
            i = self._index_of(name)
            if i is None:
                # The C library builds the message (file and tensor named) and the error type.
                c = _lib.TensorInfo()
                c.struct_size = ctypes.sizeof(c)
                _lib.call("ferry_reader_find_tensor", self.handle, _name(name), ctypes.byref(c))
                raise NotFoundError(_lib.NOT_FOUND, "%s: no tensor named %r" % (self.path, name))
            info = self._infos[name] = TensorInfo(*self._record(i)[:7])
        return info

    def metadata(self, typed=False):
        """{key: str}; with `typed`, the texts of plain values (an imported torch checkpoint's
        non-tensor entries, a nested state saved by tensorferry.torch.save_state_dict) come
        back as the ints, floats, bools, None and lists they were written from
        (tensorferry._state.decode_value); other texts stay str."""
        L = self._lib
        out = {}
        for i in range(L.ferry_reader_num_metadata(self.handle)):
            k, v = ctypes.c_void_p(), ctypes.c_void_p()
            kn, vn = ctypes.c_size_t(), ctypes.c_size_t()
            # Lengths, not NUL termination: a value may hold NUL bytes.
            _lib.call("ferry_reader_metadata_entry", self.handle, i, ctypes.byref(k),
                      ctypes.byref(kn), ctypes.byref(v), ctypes.byref(vn))
            key = _lib.decode(ctypes.string_at(k.value, kn.value), self.path, "metadata key")
            out[key] = _lib.decode(ctypes.string_at(v.value, vn.value) if vn.value else b"",
                                   self.path, "metadata value of %r" % key)
        if typed:
            out = {k: _state.decode_value(v) for k, v in out.items()}
        return out

    def scaling_state(self):
        return _scaling.read_all(self.handle)

    def verify(self, name=None):
        _lib.call("ferry_reader_verify", self.handle, None if name is None else _name(name))

    def view(self, name, verify=False):
        """A zero-copy read-only DLPackTensor over the file mapping (raw tensors only)."""
        info = self.info(name)
        out = ctypes.c_void_p()
        _lib.call("ferry_reader_view", self.handle, _name(name),
                  _lib.READ_VERIFY if verify else 0, ctypes.byref(out))
        return DLPackTensor(out.value, info.dtype)

    def read_into(self, name, ptr, nbytes, rows=None, verify=False):
        flags = _lib.READ_VERIFY if verify else 0
        if rows is None:
            _lib.call("ferry_reader_read_into", self.handle, _name(name), ctypes.c_void_p(ptr),
                      nbytes, flags)
        else:
            _lib.call("ferry_reader_read_rows_into", self.handle, _name(name), rows[0], rows[1],
                      ctypes.c_void_p(ptr), nbytes, flags)

    def region(self, name, rows=None):
        """(shape, nbytes) of a tensor or of rows [a, b) of it."""
        info = self.info(name)
        shape = info.shape
        if rows is not None:
            if not shape:
                raise InvalidArgumentError(
                    _lib.INVALID_ARGUMENT, "%s: tensor %r: a scalar has no rows" % (self.path, name))
            shape = (rows[1] - rows[0],) + tuple(shape[1:])
        return shape, _lib.storage_bytes(_dtypes.code(info.dtype), _numel(shape))


# ---- numpy --------------------------------------------------------------------------------


def _numpy_major():
    import numpy as np

    return int(np.__version__.split(".")[0])


def _numpy_copy(reader, name, rows=None, verify=False):
    import numpy as np

    info = reader.info(name)
    shape, nbytes = reader.region(name, rows)
    if info.dtype == "F4_E2M1FN":
        raw = np.empty(nbytes, np.uint8)
        reader.read_into(name, raw.ctypes.data, nbytes, rows, verify)
        codes = _dtypes.unpack_fp4(raw, _numel(shape))
        return codes.view(_dtypes.to_numpy(info.dtype)).reshape(shape)
    out = np.empty(shape, _dtypes.to_numpy(info.dtype))
    reader.read_into(name, out.ctypes.data, nbytes, rows, verify)
    return out


def _file_bytes(reader):
    """A writable numpy uint8 array over a fresh private copy-on-write mapping of the whole
    file (ferry_reader_view_file): no copy, pages shared with the page cache until written,
    writes never reaching the file or any other load."""
    import numpy as np

    out = ctypes.c_void_p()
    _lib.call("ferry_reader_view_file", reader.handle, ctypes.byref(out))
    t = DLPackTensor(out.value, "U8")
    return np.asarray(HostBuffer(t, t.shape[0]))


def _host_sources(reader, verify=False, threads=0, on_ready=None):
    """[(name, dtype code, shape, nbytes, buffer, offset)] of every tensor in name order, its
    bytes at buffer[offset:offset + nbytes] (buffer a writable numpy uint8 array).

    Unverified, raw tensors are not copied: they lie in one private copy-on-write mapping of
    the file (what safetensors' torch loads hand out too, at the cost of page faults instead
    of a copy into freshly faulted memory). The rest (compressed tensors, and every tensor
    when checksums are verified) are loaded by the library's worker threads into one host
    buffer, each at a 256-byte-aligned offset: one call into the library, no per-tensor one.

    `on_ready(entry)`, when given, is called with each entry as soon as its bytes are in place
    (views first, then the loaded ones as the library hands them over, from its hand-over
    thread) for load_iter."""
    import numpy as np

    n = len(reader._order)
    rec = reader._table
    dims = reader._dims.tolist()
    nbytes = rec["nbytes"].tolist()
    viewed = (rec["encoding"] == 0) & (rec["nbytes"] > 0)
    file = None
    if viewed.any() and not verify:
        try:
            file = _file_bytes(reader)
        except UnimplementedError:  # a file the library does not map: every tensor is copied
            pass
    if file is None:
        viewed[:] = False
    copied = [i for i in range(n) if not viewed[i] and nbytes[i] > 0]
    offsets = rec["data_offset"].tolist() if file is not None else [0] * n
    loader = _host_loader(verify, threads)
    buf = None
    everything = len(copied) == sum(1 for b in nbytes if b > 0)
    if everything and on_ready is None:  # the packed load: no request list at all
        buf = np.empty(max(1, reader._packed_bytes), np.uint8)
        offsets = rec["packed_offset"].tolist()
    elif copied:
        total = 0
        for i in copied:
            offsets[i] = total
            total += (nbytes[i] + 255) // 256 * 256
        buf = np.empty(total, np.uint8)
    codes, at, ndims = rec["dtype"].tolist(), rec["shape_offset"].tolist(), rec["ndim"].tolist()
    # Empty tensors have no bytes anywhere (buffer None).
    entries = [(reader._order[i], codes[i], tuple(dims[at[i]:at[i] + ndims[i]]), nbytes[i],
                file if viewed[i] else buf if nbytes[i] else None, offsets[i])
               for i in range(n)]
    if on_ready is not None:
        pending = set(copied)
        for i in range(n):
            if i not in pending:
                on_ready(entries[i])
    if everything and on_ready is None:
        if reader._packed_bytes:
            _lib.call("ferry_loader_load_to_host_packed", loader._handle, reader.handle,
                      ctypes.c_void_p(buf.ctypes.data), reader._packed_bytes)
    elif copied:
        reqs, keep = loader._requests(
            [(reader._order[i], None, buf.ctypes.data + offsets[i], nbytes[i]) for i in copied])
        if on_ready is None:
            _lib.call("ferry_loader_load_to_host", loader._handle, reader.handle, reqs,
                      len(copied), None)
        else:
            # Runs on the loader's hand-over thread: only hands the entry on.
            ready = _lib.READY_FN(lambda user, k, tensor, event: on_ready(entries[copied[k]]))
            _lib.call("ferry_loader_load_to_host_streaming", loader._handle, reader.handle, reqs,
                      len(copied), ready, None, None)
        del keep
    return entries


def _numpy_entry(entry, np_types):
    """The numpy array of a _host_sources entry."""
    import numpy as np

    name, code, shape, nbytes, buf, offset = entry
    dt = np_types.get(code)
    if dt is None:
        dt = np_types[code] = _dtypes.to_numpy(_dtypes.name(code))
    if buf is None:  # no bytes
        return np.empty(shape, dt)
    if code == _dtypes.code("F4_E2M1FN"):  # one element per byte in numpy
        codes = _dtypes.unpack_fp4(buf[offset:offset + nbytes], _numel(shape))
        return codes.view(dt).reshape(shape)
    return np.ndarray(shape, dt, buf, offset)


def _numpy_load_all(reader, verify=False, threads=0):
    """Every tensor as numpy arrays (see _host_sources for where their bytes lie: writable
    either way, and a write never reaches the file)."""
    np_types = {}
    return {e[0]: _numpy_entry(e, np_types) for e in _host_sources(reader, verify, threads)}


def _numpy_view(reader, name, verify=False):
    """Zero-copy view for raw tensors (a private copy-on-write mapping: writable, and writes
    stay in this process); a copy where a view cannot be had."""
    import numpy as np

    info = reader.info(name)
    if info.encoding != "raw" or info.dtype == "F4_E2M1FN" or info.nbytes == 0:
        return _numpy_copy(reader, name, verify=verify)
    t = reader.view(name, verify)
    if _dtypes.numpy_native(info.dtype) and _numpy_major() >= 2:
        return np.from_dlpack(t)
    # numpy's DLPack import knows no bfloat16/FP8/FP6: bytes, viewed as the ml_dtypes type.
    raw = np.asarray(HostBuffer(t, info.nbytes))
    return raw.view(_dtypes.to_numpy(info.dtype)).reshape(info.shape)


# ---- torch --------------------------------------------------------------------------------


def _torch():
    try:
        import torch
    except ImportError:
        raise ImportError("tensorferry: framework 'pt' needs torch") from None
    return torch


def _torch_empty(torch, dtype, shape, nbytes, device):
    tdt = _dtypes.to_torch(dtype)
    if dtype == "F4_E2M1FN":
        if tdt is not None and shape and shape[-1] % 2 == 0:
            return torch.empty(tuple(shape[:-1]) + (shape[-1] // 2,), dtype=tdt, device=device)
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    if tdt is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    return torch.empty(tuple(shape), dtype=tdt, device=device)


def _torch_view(torch, flat, offset, dtype, shape, nbytes):
    """A tensor of `dtype` and `shape` over bytes [offset, offset + nbytes) of `flat`, as
    _torch_empty would allocate it; None where no such view exists."""
    tdt = _dtypes.to_torch(dtype)
    raw = flat.narrow(0, offset, nbytes)
    try:
        if dtype == "F4_E2M1FN":
            if tdt is not None and shape and shape[-1] % 2 == 0:
                return raw.view(tdt).reshape(tuple(shape[:-1]) + (shape[-1] // 2,))
            return raw
        if tdt is None:
            return raw
        return raw.view(tdt).reshape(tuple(shape))
    except RuntimeError:
        return None


def _torch_host(reader, name, rows=None, verify=False):
    """A CPU torch tensor of `name` (rows [a, b) of it): a view of a private copy-on-write
    mapping of the tensor for raw ones (as safe_open's numpy views), else a copy."""
    torch = _torch()
    info = reader.info(name)
    shape, nbytes = reader.region(name, rows)
    # Rows of FP4 need not start on a byte: those are copied.
    if info.encoding == "raw" and info.nbytes > 0 and (rows is None or
                                                        info.dtype != "F4_E2M1FN"):
        import numpy as np

        t = reader.view(name, verify)
        flat = torch.from_numpy(np.asarray(HostBuffer(t, info.nbytes)))
        begin = 0
        if rows is not None:
            begin = rows[0] * (info.nbytes // info.shape[0]) if info.shape[0] else 0
        out = _torch_view(torch, flat, begin, info.dtype, shape, nbytes)
        if out is not None:
            return out
    out = _torch_empty(torch, info.dtype, shape, nbytes, "cpu")
    if nbytes:
        reader.read_into(name, out.data_ptr(), nbytes, rows, verify)
    return out


def _torch_entry(torch, entry, flats):
    """The CPU torch tensor of a _host_sources entry: a view of its buffer, or a copy where
    torch has no view of that dtype at that offset. `flats` caches one torch tensor per
    buffer."""
    name, code, shape, nbytes, buf, offset = entry
    dtype = _dtypes.name(code)
    flat = None
    if buf is not None:
        flat = flats.get(id(buf))
        if flat is None:
            flat = flats[id(buf)] = torch.from_numpy(buf)
    t = _torch_view(torch, flat, offset, dtype, shape, nbytes) if flat is not None else None
    if t is None:
        t = _torch_empty(torch, dtype, shape, nbytes, "cpu")
        if nbytes:
            t.view(-1).view(torch.uint8).copy_(flat.narrow(0, offset, nbytes))
    return t


def _torch_host_load_all(reader, verify=False, threads=0):
    """Every tensor as a CPU torch tensor, from _host_sources."""
    torch = _torch()
    flats = {}
    return {e[0]: _torch_entry(torch, e, flats) for e in _host_sources(reader, verify, threads)}


def _cuda_index(torch, device):
    """The device ordinal `device` means: "cuda" and torch.device("cuda") are the current
    device (torch.cuda.current_device()), never 0."""
    d = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if d.type != "cuda":
        raise ValueError("tensorferry: not a CUDA device: %r" % (device,))
    return torch.cuda.current_device() if d.index is None else d.index


_loaders = {}
_loaders_lock = threading.Lock()


def _default_loader(device_index):
    # One loader per device: a loader's events and staging work for the device it first
    # loaded to.
    with _loaders_lock:
        loader = _loaders.get(device_index)
        if loader is None:
            loader = _loaders[device_index] = Loader()
        return loader


_host_loaders = {}


def _host_loader(verify, threads=0):
    """A loader kept for host loads (its worker threads live on), one per verify setting and
    thread count."""
    key = (bool(verify), int(threads))
    with _loaders_lock:
        loader = _host_loaders.get(key)
        if loader is None:
            loader = _host_loaders[key] = Loader(verify=verify, threads=threads)
        return loader


@atexit.register
def _free_loaders():
    # Pinned memory must go back while the CUDA context still exists.
    with _loaders_lock:
        loaders = list(_loaders.values()) + list(_host_loaders.values())
        _loaders.clear()
        _host_loaders.clear()
    for loader in loaders:
        loader.close()


def _torch_cuda_load(reader, items, device, stream=None, non_blocking=False, loader=None,
                     verify=False):
    """Loads [(name, rows or None)] into new torch tensors on `device` (see _cuda_index),
    copied on `stream` (default: that device's current torch stream)."""
    torch = _torch()
    index = _cuda_index(torch, device)
    if verify:  # checksums on the host first: the shared default loader does not verify
        for name in dict.fromkeys(n for n, _ in items):
            reader.verify(name)
    with torch.cuda.device(index):
        if stream is None:
            stream = torch.cuda.current_stream(index)
        # torch.empty allocates from torch's caching allocator on the current stream, so the
        # memory is stream-ordered exactly like the copies that fill it.
        with torch.cuda.stream(stream):
            outs = []
            targets = []
            dev = torch.device("cuda", index)
            plan = [(name, rows, reader.info(name).dtype) + tuple(reader.region(name, rows))
                    for name, rows in items]
            # Many tensors share one allocation, carved into 256-byte-aligned views: one trip
            # to the allocator instead of one per tensor (fresh device memory is costly to
            # map, and a checkpoint can hold thousands of tensors).
            flat = None
            if len(plan) > 1:
                total = sum(_lib.packed_size(nb) for _, _, _, _, nb in plan)
                flat = torch.empty(total, dtype=torch.uint8, device=dev)
            at = 0
            for name, rows, dtype, shape, nbytes in plan:
                t = None
                if flat is not None:
                    t = _torch_view(torch, flat, at, dtype, shape, nbytes)
                    at += _lib.packed_size(nbytes)
                if t is None:
                    t = _torch_empty(torch, dtype, shape, nbytes, dev)
                outs.append(t)
                if nbytes:
                    targets.append((name, rows, t, nbytes))
            if targets:
                (loader or _default_loader(index)).load_into(
                    reader, targets, stream=stream.cuda_stream, non_blocking=non_blocking)
    return outs


def _torch_cuda_load_all(reader, device, verify=False):
    """Every tensor onto `device` (see _cuda_index) through one packed load: one torch
    allocation, one library call, then a view per tensor. Copies run on the device's current
    torch stream; returns once they are complete."""
    torch = _torch()
    index = _cuda_index(torch, device)
    if verify:  # checksums on the host first: the shared default loader does not verify
        reader.verify()
    nbytes_all = reader._packed_bytes
    with torch.cuda.device(index):
        stream = torch.cuda.current_stream(index)
        with torch.cuda.stream(stream):
            dev = torch.device("cuda", index)
            flat = torch.empty(max(1, nbytes_all), dtype=torch.uint8, device=dev)
            if nbytes_all:
                _lib.call("ferry_loader_load_packed", _default_loader(index)._handle,
                          reader.handle, ctypes.c_void_p(flat.data_ptr()), nbytes_all,
                          ctypes.c_void_p(stream.cuda_stream))
            out = {}
            copied = False
            for i in range(len(reader._order)):
                name, code, shape, nbytes, _, _, _, offset = reader._record(i)
                dtype = _dtypes.name(code)
                t = _torch_view(torch, flat, offset, dtype, shape, nbytes)
                if t is None:  # no view of that dtype and shape: a copy of the bytes
                    t = _torch_empty(torch, dtype, shape, nbytes, dev)
                    if nbytes:
                        t.view(-1).view(torch.uint8).copy_(flat.narrow(0, offset, nbytes))
                        copied = True
                out[name] = t
            if copied:
                stream.synchronize()
    return out


def load_iter(path, device="cuda", verify=False, framework=None, threads=0):
    """Yields (name, tensor) for every tensor of a checkpoint as soon as it is in place,
    while the rest still loads, so a framework can build modules as their weights land. Each
    tensor comes exactly once.

    `device`: "cuda" (the current device), "cuda:N" or a torch.device: torch tensors, in the
    order their copies finish (file order, give or take the interleaving of the copy
    threads), copied on that device's current torch stream into one allocation shared by all
    tensors (as load_file); a yielded tensor is complete: any stream may read it. "cpu": numpy
    arrays (torch CPU tensors with framework="pt"), as load_file makes them: raw tensors
    first, at once (views of the file's private mapping), then the decoded ones as the
    library's `threads` workers finish them. Leaving the loop early waits for the load to
    finish before the generator closes. Errors are raised at the point of iteration where
    they happen, after the tensors handed over before them."""
    framework, device = _resolve(framework, device)
    if device == "cpu":
        yield from _host_iter(path, framework, verify, threads)
        return
    yield from _cuda_iter(path, device, verify)


def _background_iter(reader, run):
    """Yields what `run(put)`, running on a thread of its own, puts, until it returns; then
    raises what it raised. Leaving early waits for it; the reader is closed at the end."""
    import queue

    ready = queue.SimpleQueue()
    failure = []

    def body():
        try:
            run(ready.put)
        except BaseException as e:  # noqa: B902 - raised in the consumer's thread below
            failure.append(e)
        finally:
            ready.put(None)

    thread = threading.Thread(target=body, name="tensorferry-load-iter", daemon=True)
    try:
        thread.start()
        while True:
            item = ready.get()
            if item is None:
                break
            yield item
        thread.join()
        if failure:
            raise failure[0]
    finally:
        if thread.is_alive():  # left early: the load still writes into its buffers
            thread.join()
        reader.close()


def _host_iter(path, framework, verify, threads):
    if framework == "np":
        np_types = {}
        convert = lambda e: _numpy_entry(e, np_types)  # noqa: E731
    else:
        torch, flats = _torch(), {}
        convert = lambda e: _torch_entry(torch, e, flats)  # noqa: E731
    reader = Reader(path)
    for entry in _background_iter(
            reader, lambda put: _host_sources(reader, verify, threads, on_ready=put)):
        yield entry[0], convert(entry)


def _cuda_iter(path, device, verify):
    import queue

    torch = _torch()
    index = _cuda_index(torch, device)
    reader = Reader(path)
    thread = None
    try:
        if verify:
            reader.verify()
        nbytes_all = reader._packed_bytes
        with torch.cuda.device(index):
            stream = torch.cuda.current_stream(index)
            dev = torch.device("cuda", index)
            with torch.cuda.stream(stream):
                flat = torch.empty(max(1, nbytes_all), dtype=torch.uint8, device=dev)
        ready = queue.SimpleQueue()
        failure = []
        # Called on the loader's hand-over thread; only queues the index.
        callback = _lib.READY_FN(lambda user, i, tensor, event: ready.put(i))
        loader = _default_loader(index)

        def run():
            try:
                with torch.cuda.device(index):  # the loader targets this thread's device
                    _lib.call("ferry_loader_load_packed_streaming", loader._handle,
                              reader.handle, ctypes.c_void_p(flat.data_ptr()), nbytes_all,
                              _lib.HAND_OVER_COMPLETE, callback, None,
                              ctypes.c_void_p(stream.cuda_stream))
            except BaseException as e:  # raised in the consumer's thread below
                failure.append(e)
            finally:
                ready.put(None)

        thread = threading.Thread(target=run, name="tensorferry-load-iter", daemon=True)
        thread.start()
        while True:
            i = ready.get()
            if i is None:
                break
            name, code, shape, nbytes, _, _, _, offset = reader._record(i)
            dtype = _dtypes.name(code)
            t = _torch_view(torch, flat, offset, dtype, shape, nbytes)
            if t is None:  # no view of that dtype and shape: a copy of the bytes
                with torch.cuda.device(index):
                    t = _torch_empty(torch, dtype, shape, nbytes, dev)
                    if nbytes:
                        t.view(-1).view(torch.uint8).copy_(flat.narrow(0, offset, nbytes))
                        torch.cuda.current_stream(index).synchronize()
            yield name, t
        thread.join()
        thread = None
        if failure:
            raise failure[0]
    finally:
        if thread is not None:  # left early: the load still writes into `flat`
            thread.join()
        reader.close()


class Loader(_Closable):
    """A TensorFerry loader: a pinned staging ring reused across loads. Copies go to the
    calling thread's current CUDA device, on the given stream. Close it (or let the process
    exit) while the CUDA context is alive.

    The options are ferry::LoaderOptions (include/ferry/loader.hpp); None keeps the library's
    default. ``io``: "auto" (page cache when the file is resident, else O_DIRECT), "page_cache"
    or "direct". ``host_path``: "auto", "staging", "register" or "register_windows".
    ``pinned_alloc``: "host_register" or "host_alloc". ``chunk_bytes`` is the former name of
    ``slot_bytes``."""

    _IO = {"auto": 0, "page_cache": 1, "direct": 2}
    _HOST_PATH = {"auto": 0, "staging": 1, "register": 2, "register_windows": 3}
    _PINNED = {"host_register": 0, "host_alloc": 1}

    def __init__(self, staging_bytes=None, slot_bytes=None, threads=0, verify=False, io="auto",
                 host_path="auto", pinned_alloc="host_register", register_window_bytes=None,
                 streaming_stores=False, *, chunk_bytes=None):
        L = _lib.lib()
        opts = _lib.LoaderOptions()
        L.ferry_loader_options_init(ctypes.byref(opts))
        if slot_bytes is None:
            slot_bytes = chunk_bytes
        for field, value in (("staging_bytes", staging_bytes), ("slot_bytes", slot_bytes),
                             ("register_window_bytes", register_window_bytes)):
            if value is not None:
                setattr(opts, field, int(value))
        opts.threads = int(threads)
        opts.verify = 1 if verify else 0
        opts.streaming_stores = 1 if streaming_stores else 0
        for field, value, names in (("io", io, self._IO), ("host_path", host_path, self._HOST_PATH),
                                    ("pinned_alloc", pinned_alloc, self._PINNED)):
            if value not in names:
                raise ValueError("tensorferry: %s must be one of %s, got %r"
                                 % (field, sorted(names), value))
            setattr(opts, field, names[value])
        handle = ctypes.c_void_p()
        _lib.call("ferry_loader_create", ctypes.byref(opts), ctypes.byref(handle))
        self._handle = handle
        self._lib = L
        self._lock = threading.Lock()

    def close(self):
        with self._lock:
            h, self._handle = self._handle, None
        if h is not None:
            self._lib.ferry_loader_free(h)


    def _requests(self, items):
        reqs = (_lib.LoadRequest * max(1, len(items)))()
        keep = []
        for i, (name, rows, ptr, nbytes) in enumerate(items):
            b = _name(name)
            keep.append(b)
            reqs[i].name = b
            reqs[i].row_begin = rows[0] if rows else 0
            reqs[i].row_end = rows[1] if rows else -1
            reqs[i].dst = ptr
            reqs[i].dst_bytes = nbytes
        return reqs, keep

    def load_into(self, reader, targets, stream=None, non_blocking=False):
        """Copies tensors into caller buffers on the current device: targets is a list of
        (name, rows or None, destination, nbytes), destination a torch tensor or a device
        pointer. `stream` is a cudaStream_t as int (None: the legacy default stream). Without
        non_blocking the call waits for `stream`."""
        items = [(n, r, d.data_ptr() if hasattr(d, "data_ptr") else int(d), nb)
                 for n, r, d, nb in targets]
        reqs, keep = self._requests(items)
        fn = "ferry_loader_load_async" if non_blocking else "ferry_loader_load"
        _lib.call(fn, self._handle, reader.handle, reqs, len(items), None, None,
                  ctypes.c_void_p(stream or 0))
        del keep

    def load(self, reader, names=None, stream=None):
        """Loads tensors (default: all) into memory the loader allocates on the current device
        (cudaMallocAsync on `stream`), waits for `stream`, and returns {name: DLPackTensor}
        for any DLPack consumer (torch, cupy, jax)."""
        return self._load(reader, names, stream, host=False)

    def load_to_host(self, reader, names=None):
        """As load, into host memory (needs no GPU); returns {name: DLPackTensor}."""
        return self._load(reader, names, None, host=True)

    def _load(self, reader, names, stream, host):
        names = reader.keys() if names is None else list(names)
        items = [(n, None, None, 0) for n in names]
        reqs, keep = self._requests(items)
        out = (ctypes.c_void_p * max(1, len(items)))()
        if not items:
            return {}
        if host:
            _lib.call("ferry_loader_load_to_host", self._handle, reader.handle, reqs, len(items),
                      out)
        else:
            _lib.call("ferry_loader_load", self._handle, reader.handle, reqs, len(items), None,
                      out, ctypes.c_void_p(stream or 0))
        del keep
        return {n: DLPackTensor(out[i], reader.info(n).dtype) for i, n in enumerate(names)}


# ---- public reading API -------------------------------------------------------------------


def _resolve(framework, device):
    """(framework, device) with framework "np" or "pt" and device "cpu" or a CUDA spec."""
    torch_device = type(device).__name__ == "device" and type(device).__module__ == "torch"
    if device is None:
        device = "cpu"
    is_cpu = (str(device) == "cpu")
    if framework is None:
        framework = "np" if is_cpu and not torch_device else "pt"
    framework = {"numpy": "np", "torch": "pt", "pytorch": "pt"}.get(framework, framework)
    if framework not in ("np", "pt"):
        raise ValueError("tensorferry: framework must be 'np' or 'pt', got %r" % (framework,))
    if not is_cpu:
        if framework == "np":
            raise ValueError("tensorferry: numpy arrays live on the host; use device='cpu' or "
                             "framework='pt' for %r" % (device,))
        if not (isinstance(device, int) or str(device).startswith("cuda")):
            raise ValueError("tensorferry: device must be 'cpu', 'cuda' or 'cuda:N', got %r"
                             % (device,))
    return framework, ("cpu" if is_cpu else device)


def load_file(path, device=None, framework=None, verify=False, threads=0):
    """Loads every tensor of a checkpoint into a dict.

    device None or "cpu": numpy arrays, or torch CPU tensors with framework="pt". Raw
    tensors are not copied: they are views of one private copy-on-write mapping of the file
    (as safetensors' torch loads are), writable, and a write stays in the array; compressed
    tensors (and, with `verify`, every tensor, its checksums checked) are decoded by the
    library's worker threads into one buffer. `threads`: those workers (0: one per core, up
    to the library's default). device "cuda" (the current device), "cuda:N" or a
    torch.device: torch tensors on that device, copied on its current torch stream (the call
    returns once they are complete). FP6 tensors come to torch as uint8; FP4 as
    float4_e2m1fn_x2 (uint8 bytes when the last dimension is odd).
    """
    framework, device = _resolve(framework, device)
    with Reader(path) as r:
        if framework == "np":
            return _numpy_load_all(r, verify=verify, threads=threads)
        if device == "cpu":
            return _torch_host_load_all(r, verify=verify, threads=threads)
        return _torch_cuda_load_all(r, device, verify=verify)


def read_metadata(path, typed=False):
    """The checkpoint's string metadata as a dict; with `typed`, plain values come back typed
    (see Reader.metadata): ``{"epoch": 7, "lr": 0.5}`` rather than ``{"epoch": "7", ...}``."""
    with Reader(path) as r:
        return r.metadata(typed)


def read_scaling_state(path):
    """The FP8 scaling state, structured (see tensorferry._scaling), with numpy arrays."""
    with Reader(path) as r:
        return r.scaling_state()


class safe_open:
    """Lazy access to a checkpoint, in the shape of safetensors.safe_open.

    framework "np": device must be "cpu"; get_tensor returns zero-copy views of the file for
    raw-encoded tensors (copies for compressed and FP4 tensors). framework "pt": device "cpu"
    gives torch copies; "cuda" (current device), "cuda:N" load to the GPU on its current torch
    stream.

    Behaves as safetensors' safe_open does: a missing file raises FileNotFoundError;
    metadata() is None when the file has none; get_slice(name)[...] takes ints, slices (with
    steps), Ellipsis and tuples of them; every call after close (or after the ``with`` block)
    raises. Slices clamp as in Python, numpy and torch: on 3 rows, ``[1:10]`` is 2 rows,
    ``[5:]`` none and ``[-10:]`` all 3 (so the last rank of a tensor-parallel split may ask
    past the end); an int index out of range raises IndexError. Where it differs, on purpose:
    - errors are tensorferry's types, not SafetensorError: NotFoundError (a LookupError) for
      an unknown tensor, IndexError for an index out of range, ValueError on a closed file;
    - numpy views of raw tensors are not copies but private copy-on-write mappings: writable,
      and a write changes only that array (never the file, nor another view);
    - negative slice bounds count from the end, as in Python;
    - metadata() cannot tell an empty dict from none: both give None.
    """

    def __init__(self, filename, framework="np", device="cpu", verify=False):
        self._framework, self._device = _resolve(framework, device)
        self._verify = verify
        self._reader = Reader(filename)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self._reader.close()

    def keys(self):
        return self._reader.keys()

    def metadata(self):
        return self._reader.metadata() or None

    def scaling_state(self):
        return self._reader.scaling_state()

    def info(self, name):
        return self._reader.info(name)

    def get_tensor(self, name):
        return self._get(name, None)

    def get_slice(self, name):
        return _Slice(self, name)

    def _get(self, name, rows):
        r = self._reader
        if self._framework == "np":
            if rows is None:
                return _numpy_view(r, name, self._verify)
            info = r.info(name)
            if info.encoding == "raw" and info.dtype != "F4_E2M1FN" and not self._verify:
                return _numpy_view(r, name)[rows[0]:rows[1]]
            return _numpy_copy(r, name, rows, self._verify)
        if self._device == "cpu":
            return _torch_host(r, name, rows, self._verify)
        return _torch_cuda_load(r, [(name, rows)], self._device, verify=self._verify)[0]


def _expand_index(key, shape, name):
    """`key` as a tuple of one int or slice per leading dimension (Ellipsis expanded); int
    indices are checked against `shape`, slice bounds are left to clamp (slice.indices)."""
    if not isinstance(key, tuple):
        key = (key,)
    if sum(k is Ellipsis for k in key) > 1:
        raise IndexError("tensorferry: an index can only have a single ellipsis (...)")
    if Ellipsis in key:
        at = key.index(Ellipsis)
        fill = max(0, len(shape) - (len(key) - 1))
        key = key[:at] + (slice(None),) * fill + key[at + 1:]
    if len(key) > len(shape):
        raise IndexError("tensorferry: too many indices for tensor %r of shape %s"
                         % (name, list(shape)))
    out = []
    for dim, (k, n) in enumerate(zip(key, shape)):
        if isinstance(k, slice):
            bounds = [b if b is None else operator.index(b) for b in (k.start, k.stop)]
            step = 1 if k.step is None else operator.index(k.step)
            if step == 0:
                raise ValueError("tensorferry: slice step cannot be zero")
            out.append(slice(bounds[0], bounds[1], step))
        else:
            try:
                i = operator.index(k)
            except TypeError:
                raise TypeError("tensorferry: tensor %r: indices must be int, slice or ..., "
                                "got %r" % (name, k)) from None
            if not -n <= i < n:
                raise IndexError("tensorferry: index %d out of bounds for dimension %d of size "
                                 "%d of tensor %r" % (i, dim, n, name))
            out.append(i)
    return tuple(out)


class _Slice:
    """Indexed access to one tensor: reads only the rows of dimension 0 that the index
    selects (one contiguous range), then applies the rest of the index to them."""

    def __init__(self, owner, name):
        self._owner = owner
        self._name = name
        self._info = owner._reader.info(name)

    def get_shape(self):
        return list(self._info.shape)

    def get_dtype(self):
        return self._info.dtype

    def __getitem__(self, key):
        shape = self._info.shape
        key = _expand_index(key, shape, self._name)
        if not key:
            return self._owner._get(self._name, None)
        first, rest = key[0], key[1:]
        flip = False
        if isinstance(first, slice):
            start, stop, step = first.indices(shape[0])
            count = len(range(start, stop, step))
            if count == 0:
                lo = hi = 0
                sub = slice(0, 0)
            elif step > 0:
                lo, hi = start, start + (count - 1) * step + 1
                sub = slice(None, None, step)
            else:
                # Rows start, start+step, ...: read the span once, select with a positive
                # step from its far end, then reverse (torch has no negative steps).
                last = start + (count - 1) * step
                lo, hi = last, start + 1
                sub, flip = slice(None, None, -step), True
        else:
            lo = first % shape[0]
            hi, sub = lo + 1, 0
        out = self._owner._get(self._name, (lo, hi))
        if sub != slice(None, None, 1) or rest:
            out = out[(sub,) + rest]
        if flip:
            out = out.flip(0) if hasattr(out, "flip") else out[::-1]
        return out


# ---- bytes --------------------------------------------------------------------------------


def _save_bytes(tensors, metadata, **options):
    """The bytes of the checkpoint save_file would write. The writer works on files: it writes
    a temporary one (not fsynced) and reads it back."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tensorferry-") as tmp:
        path = os.path.join(tmp, "checkpoint.ferry")
        save_file(tensors, path, metadata=metadata, durable=False, **options)
        with open(path, "rb") as f:
            return f.read()


def _load_bytes(data, load):
    """load(path) over a checkpoint given as bytes, held in an anonymous in-memory file
    (memfd) where the system has them, else in a temporary file. What `load` returns may view
    the file: a mapping keeps it alive after it is closed and removed."""
    import tempfile

    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError("tensorferry: load expects bytes, got %s" % type(data).__name__)
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("tensorferry", getattr(os, "MFD_CLOEXEC", 0))
        try:
            with os.fdopen(os.dup(fd), "wb") as f:
                f.write(data)
            return load("/proc/self/fd/%d" % fd)
        finally:
            os.close(fd)
    with tempfile.TemporaryDirectory(prefix="tensorferry-") as tmp:
        path = os.path.join(tmp, "checkpoint.ferry")
        with open(path, "wb") as f:
            f.write(data)
        return load(path)
