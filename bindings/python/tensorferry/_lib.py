"""ctypes declarations of the C API (include/ferry/ferry.h) and the library loader.

Where libferry.so comes from, first match wins:
1. ``tensorferry.load_library(path)``, called before anything else touches the library;
2. the ``TENSORFERRY_LIBRARY`` environment variable (a path to libferry.so);
3. ``libferry.so`` (or ``libferry.so.<N>``) inside the installed package directory;
4. a CMake build tree of the source checkout this package sits in
   (``<repo>/build*/src/libferry.so``; the most recently built one);
5. the system's library path (``ctypes.util.find_library("ferry")``).
"""

import ctypes
import ctypes.util
import errno
import glob
import os
import threading

c_int32 = ctypes.c_int32
c_uint32 = ctypes.c_uint32
c_int64 = ctypes.c_int64
c_uint64 = ctypes.c_uint64
c_size_t = ctypes.c_size_t
c_void_p = ctypes.c_void_p
c_char_p = ctypes.c_char_p
POINTER = ctypes.POINTER

ERROR_MESSAGE_SIZE = 1024

# Status codes (ferry/ferry.h, equal to ferry::StatusCode).
OK = 0
INVALID_ARGUMENT = 1
NOT_FOUND = 2
DATA_LOSS = 3
RESOURCE_EXHAUSTED = 4
UNIMPLEMENTED = 5
INTERNAL = 6
CUDA_ERROR = 7
IO_ERROR = 8

ENCODING_DEFAULT = -1
# The library's names (ferry::EncodingName, what `ferry` and TensorInfo.encoding print), and
# "shuffle_zstd", the spelling that reads as a Python word: both are taken everywhere.
ENCODINGS = {"raw": 0, "zstd": 1, "shuffle+zstd": 2, "shuffle_zstd": 2, "planes": 3}
ENCODING_NAMES = {0: "raw", 1: "zstd", 2: "shuffle+zstd", 3: "planes"}


def encoding_code(name):
    """The library's code of an encoding name; ValueError listing the names otherwise."""
    code = ENCODINGS.get(name) if isinstance(name, str) else None
    if code is None:
        raise ValueError("tensorferry: encoding must be one of 'raw', 'zstd', 'shuffle+zstd' "
                         "(or 'shuffle_zstd'), 'planes'; got %r" % (name,))
    return code

READ_VERIFY = 1
PACKED_ALIGNMENT = 256  # FERRY_PACKED_ALIGNMENT: where packed loads place each tensor

DLPACK_FLAG_BITMASK_READ_ONLY = 1 << 0
DLPACK_FLAG_BITMASK_IS_COPIED = 1 << 1
KDLCPU = 1
KDLCUDA = 2
KDLCUDAHOST = 3


# ---- DLPack 1.x structures ----------------------------------------------------------------


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", c_void_p),
        ("device", DLDevice),
        ("ndim", c_int32),
        ("dtype", DLDataType),
        ("shape", POINTER(c_int64)),
        ("strides", POINTER(c_int64)),
        ("byte_offset", c_uint64),
    ]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", c_void_p),
        ("deleter", c_void_p),
        ("flags", c_uint64),
        ("dl_tensor", DLTensor),
    ]


# ---- ferry structures ---------------------------------------------------------------------


class Error(ctypes.Structure):
    _fields_ = [("code", ctypes.c_int), ("message", ctypes.c_char * ERROR_MESSAGE_SIZE)]


# int32_t (*)(void* user, uint64_t raw_bytes_written): ferry_writer_options_t.progress
PROGRESS_FN = ctypes.CFUNCTYPE(c_int32, c_void_p, c_uint64)


class WriterOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("block_size", c_uint64),
        ("encoding", c_int32),
        ("zstd_level", c_int32),
        ("min_savings", ctypes.c_double),
        ("threads", c_int32),
        ("durable", c_int32),
        ("producer", c_char_p),
        ("staging", c_void_p),
        ("direct_io", c_int32),
        ("progress", PROGRESS_FN),
        ("progress_user", c_void_p),
    ]


class Recipe(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("kind", c_int32),
        ("fp8_format", c_int32),
        ("margin", c_int32),
        ("amax_history_len", c_int32),
        ("amax_compute_algo", c_int32),
        ("reduce_amax", c_int32),
        ("fp8_dpa", c_int32),
        ("fp8_mha", c_int32),
        ("x_block_scaling_dim", c_int32),
        ("w_block_scaling_dim", c_int32),
        ("grad_block_scaling_dim", c_int32),
        ("disable_rht", c_int32),
        ("disable_stochastic_rounding", c_int32),
        ("disable_2d_quantization", c_int32),
        ("custom_name", c_char_p),
        ("custom_qfactory", c_char_p),
    ]


class DirectionState(ctypes.Structure):
    _fields_ = [
        ("direction", c_int32),
        ("num_gemms", c_int32),
        ("num_slots", c_int32),
        ("history_len", c_int32),
        ("slot_roles", POINTER(c_int32)),
        ("scale", POINTER(ctypes.c_float)),
        ("amax_history", POINTER(ctypes.c_float)),
    ]


class ScalingState(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("module", c_char_p),
        ("recipe", Recipe),
        ("num_states", c_size_t),
        ("states", POINTER(DirectionState)),
    ]


class ReaderOptions(ctypes.Structure):
    _fields_ = [("struct_size", c_size_t), ("verify_on_open", c_int32), ("ca_bundle", c_char_p),
                ("max_attempts", c_int32), ("max_in_flight", c_int32),
                ("piece_bytes", c_uint64)]


class TensorInfo(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("name", c_char_p),
        ("dtype", c_int32),
        ("ndim", c_int32),
        ("shape", POINTER(c_int64)),
        ("nbytes", c_uint64),
        ("data_offset", c_uint64),
        ("data_size", c_uint64),
        ("encoding", c_int32),
        ("block_size", c_uint64),
        ("index", c_size_t),
    ]


class TensorRecord(ctypes.Structure):
    _fields_ = [
        ("name_offset", c_uint64),
        ("name_size", c_uint64),
        ("shape_offset", c_uint64),
        ("nbytes", c_uint64),
        ("data_offset", c_uint64),
        ("data_size", c_uint64),
        ("block_size", c_uint64),
        ("packed_offset", c_uint64),
        ("dtype", c_int32),
        ("ndim", c_int32),
        ("encoding", c_int32),
        ("reserved", c_int32),
    ]


def record_dtype(record_size):
    """The numpy dtype of TensorRecord (ferry_tensor_record_t) for records `record_size` bytes
    apart (a newer library may append fields)."""
    import numpy as np

    d = np.dtype(TensorRecord)
    return np.dtype({"names": list(d.names), "formats": [d.fields[n][0] for n in d.names],
                     "offsets": [d.fields[n][1] for n in d.names], "itemsize": record_size})


class TensorTable(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("num_tensors", c_size_t),
        ("record_size", c_size_t),
        ("records", c_void_p),
        ("names", c_void_p),
        ("names_size", c_uint64),
        ("shapes", c_void_p),
        ("num_shape_entries", c_uint64),
        ("packed_bytes", c_uint64),
    ]


# ferry_ready_fn: (user, index, const DLTensor*, event).
READY_FN = ctypes.CFUNCTYPE(None, c_void_p, c_size_t, c_void_p, c_void_p)
HAND_OVER_COMPLETE = 0
HAND_OVER_ENQUEUED = 1


class PlanItem(ctypes.Structure):
    _fields_ = [("bytes", c_uint64), ("row_bytes", c_uint64)]


class PlanPiece(ctypes.Structure):
    _fields_ = [("item", c_uint32), ("segment", c_uint32), ("begin", c_uint64), ("len", c_uint64)]


# int32_t (*)(void* user, uint64_t* words, size_t count): ferry_all_reduce_max_fn
ALL_REDUCE_MAX_FN = ctypes.CFUNCTYPE(c_int32, c_void_p, POINTER(c_uint64), c_size_t)


class ShardedSaveOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("rank", c_int32),
        ("nranks", c_int32),
        ("all_reduce_max", ALL_REDUCE_MAX_FN),
        ("all_reduce_user", c_void_p),
        ("writer", POINTER(WriterOptions)),
        ("metadata_keys", POINTER(c_char_p)),
        ("metadata_values", POINTER(c_char_p)),
        ("num_metadata", c_size_t),
        ("remove_replaced", c_int32),
    ]


DIST_OWN_BUFFER = (1 << 64) - 1


class DistPlanOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("rank", c_int32),
        ("nranks", c_int32),
        ("rounds", c_int32),
        ("check_plan", c_int32),
        ("own_min_bytes", c_uint64),
        ("all_reduce_max", ALL_REDUCE_MAX_FN),
        ("all_reduce_user", c_void_p),
        ("local_names", POINTER(c_char_p)),
        ("num_local", c_size_t),
    ]


class DistItem(ctypes.Structure):
    _fields_ = [
        ("name", c_char_p),
        ("request", c_size_t),
        ("shard", c_uint32),
        ("reserved", c_int32),
        ("bytes", c_uint64),
        ("row_bytes", c_uint64),
        ("arena_offset", c_uint64),
        ("row_begin", c_int64),
        ("row_end", c_int64),
    ]


class DistBroadcast(ctypes.Structure):
    _fields_ = [
        ("round", c_int32),
        ("root", c_int32),
        ("item", c_uint32),
        ("reserved", c_int32),
        ("begin", c_uint64),
        ("bytes", c_uint64),
    ]


class DistRead(ctypes.Structure):
    _fields_ = [
        ("round", c_int32),
        ("item", c_uint32),
        ("begin", c_uint64),
        ("bytes", c_uint64),
        ("row_begin", c_int64),
        ("row_end", c_int64),
    ]


class DistPlanView(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("num_items", c_size_t),
        ("items", POINTER(DistItem)),
        ("arena_bytes", c_uint64),
        ("num_broadcasts", c_size_t),
        ("broadcasts", POINTER(DistBroadcast)),
        ("num_reads", c_size_t),
        ("reads", POINTER(DistRead)),
        ("rounds", c_int32),
    ]


class LoaderOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("staging_bytes", c_uint64),
        ("slot_bytes", c_uint64),
        ("threads", c_int32),
        ("host_path", c_int32),
        ("pinned_alloc", c_int32),
        ("verify", c_int32),
        ("io", c_int32),
        ("register_window_bytes", c_uint64),
        ("streaming_stores", c_int32),
    ]


class LoadRequest(ctypes.Structure):
    _fields_ = [
        ("name", c_char_p),
        ("row_begin", c_int64),
        ("row_end", c_int64),
        ("dst", c_void_p),
        ("dst_bytes", c_uint64),
    ]


# ---- errors -------------------------------------------------------------------------------


class FerryError(RuntimeError):
    """A TensorFerry call failed. ``code`` is the C status code, ``status`` its name."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code
        self.status = _STATUS_NAMES.get(code, "Unknown")


class InvalidArgumentError(FerryError, ValueError):
    pass


class NotFoundError(FerryError, LookupError):
    pass


class MissingFileError(NotFoundError, FileNotFoundError):
    """The checkpoint file does not exist: a FileNotFoundError, as Python's open() raises."""

    def __init__(self, code, message, filename=None):
        super().__init__(code, message)
        self.errno = errno.ENOENT
        self.strerror = message
        self.filename = filename

    def __str__(self):
        return self.strerror


class DataLossError(FerryError):
    pass


class ResourceExhaustedError(FerryError, MemoryError):
    pass


class UnimplementedError(FerryError, NotImplementedError):
    pass


class InternalError(FerryError):
    pass


class CudaError(FerryError):
    pass


class IoError(FerryError, OSError):
    """The system refused a read, write, sync or rename: an OSError whose ``errno`` is the
    system's (ENOSPC for a full disk, EFBIG past a file size limit, ...). ``str()`` is the
    library's message, which names the file."""

    def __str__(self):
        return self.args[0] if self.args else ""


_STATUS_NAMES = {
    OK: "OK",
    INVALID_ARGUMENT: "InvalidArgument",
    NOT_FOUND: "NotFound",
    DATA_LOSS: "DataLoss",
    RESOURCE_EXHAUSTED: "ResourceExhausted",
    UNIMPLEMENTED: "Unimplemented",
    INTERNAL: "Internal",
    CUDA_ERROR: "CudaError",
    IO_ERROR: "IoError",
}

_ERROR_TYPES = {
    INVALID_ARGUMENT: InvalidArgumentError,
    NOT_FOUND: NotFoundError,
    DATA_LOSS: DataLossError,
    RESOURCE_EXHAUSTED: ResourceExhaustedError,
    UNIMPLEMENTED: UnimplementedError,
    INTERNAL: InternalError,
    CUDA_ERROR: CudaError,
    IO_ERROR: IoError,
}


# Python's own OSError subclasses for the errnos that have one, as open() raises them.
_ERRNO_TYPES = {
    errno.ENOENT: FileNotFoundError,
    errno.EEXIST: FileExistsError,
    errno.EISDIR: IsADirectoryError,
    errno.ENOTDIR: NotADirectoryError,
    errno.EACCES: PermissionError,
    errno.EPERM: PermissionError,
}
_errno_types = {}


def _error_type(code, err_no):
    """The class for status `code` given the system's errno (0: none): IoError, and NotFound
    from a system call, become OSErrors and, where Python has one, its subclass for that errno
    (a save into a missing folder is a FileNotFoundError)."""
    base = _ERROR_TYPES.get(code, FerryError)
    if err_no == 0 or code not in (IO_ERROR, NOT_FOUND):
        return base
    if code == NOT_FOUND:
        base = MissingFileError
    specific = _ERRNO_TYPES.get(err_no)
    if specific is None or issubclass(base, specific):
        return base
    key = (base, specific)
    if key not in _errno_types:
        _errno_types[key] = type(base.__name__, (base, specific), {"__module__": __name__})
    return _errno_types[key]


def raise_error(code, err):
    message = err.message.decode("utf-8", "replace") if err is not None else ""
    message = message or _STATUS_NAMES.get(code, "error")
    err_no = lib().ferry_error_errno(ctypes.byref(err)) if err is not None else 0
    cls = _error_type(code, err_no)
    e = cls(code, message)
    if err_no:
        e.errno = err_no
        if not isinstance(e, MissingFileError):
            e.strerror = os.strerror(err_no)
    raise e


# ---- library ------------------------------------------------------------------------------

_lock = threading.Lock()
_lib = None
_lib_path = None


def _candidates():
    env = os.environ.get("TENSORFERRY_LIBRARY")
    if env:
        yield env
        return
    here = os.path.dirname(os.path.abspath(__file__))
    for name in sorted(glob.glob(os.path.join(here, "libferry.so*"))):
        yield name
    repo = os.path.dirname(os.path.dirname(os.path.dirname(here)))
    builds = glob.glob(os.path.join(repo, "build*", "src", "libferry.so"))
    for name in sorted(builds, key=os.path.getmtime, reverse=True):
        yield name
    system = ctypes.util.find_library("ferry")
    if system:
        yield system


def load_library(path=None):
    """Loads libferry.so (from ``path``, else by the search order above) and returns it.

    Calling it again with the same (or no) path returns the loaded library; a different path
    after the library is loaded raises RuntimeError.
    """
    global _lib, _lib_path
    with _lock:
        if _lib is not None:
            if path is not None and os.path.realpath(path) != os.path.realpath(_lib_path):
                raise RuntimeError(
                    "tensorferry: libferry is already loaded from %s" % _lib_path)
            return _lib
        tried = []
        for candidate in [path] if path is not None else _candidates():
            if not os.path.sep in candidate or os.path.exists(candidate):
                try:
                    lib = ctypes.CDLL(candidate)
                except OSError as e:
                    tried.append("%s (%s)" % (candidate, e))
                    continue
                _declare(lib)
                _lib, _lib_path = lib, candidate
                return lib
            tried.append("%s (missing)" % candidate)
        raise OSError(
            "tensorferry: cannot find libferry.so. Build it (cmake --build build) or set "
            "TENSORFERRY_LIBRARY=/path/to/libferry.so. Tried: " + (", ".join(tried) or "none"))


def lib():
    return _lib if _lib is not None else load_library()


def library_path():
    lib()
    return _lib_path


def _declare(lib):
    E = POINTER(Error)
    I = ctypes.c_int

    def fn(name, restype, *argtypes):
        f = getattr(lib, name)
        f.restype = restype
        f.argtypes = list(argtypes)

    fn("ferry_status_name", c_char_p, I)
    fn("ferry_error_errno", I, E)
    fn("ferry_version", c_char_p)
    fn("ferry_format_version", c_uint32)
    fn("ferry_dtype_name", c_char_p, c_int32)
    fn("ferry_dtype_parse", I, c_char_p, POINTER(c_int32), E)
    fn("ferry_dtype_storage_bytes", I, c_int32, c_uint64, POINTER(c_uint64), E)
    fn("ferry_dtype_to_dlpack", I, c_int32, POINTER(DLDataType), E)
    fn("ferry_dtype_from_dlpack", I, DLDataType, POINTER(c_int32), E)
    fn("ferry_dlpack_free", None, c_void_p)
    fn("ferry_dlpack_to_legacy", I, c_void_p, POINTER(c_void_p), E)
    fn("ferry_dlpack_legacy_free", None, c_void_p)
    fn("ferry_dlpack_capsule_destructor", None, c_void_p)

    fn("ferry_writer_options_init", None, POINTER(WriterOptions))
    fn("ferry_writer_create", I, c_char_p, POINTER(WriterOptions), POINTER(c_void_p), E)
    fn("ferry_writer_add_tensor", I, c_void_p, c_char_p, c_int32, POINTER(c_int64), c_int32,
       c_void_p, c_uint64, c_int32, E)
    fn("ferry_writer_set_metadata", I, c_void_p, c_char_p, c_char_p, E)
    fn("ferry_convert", I, c_char_p, c_char_p, POINTER(WriterOptions), E)
    fn("ferry_convert_to", I, c_char_p, c_char_p, c_char_p, POINTER(WriterOptions), E)
    fn("ferry_recipe_init", None, POINTER(Recipe), c_int32)
    fn("ferry_writer_add_scaling_state", I, c_void_p, c_char_p, POINTER(Recipe),
       POINTER(DirectionState), c_size_t, E)
    fn("ferry_writer_commit", I, c_void_p, E)
    fn("ferry_writer_add_device_tensor_async", I, c_void_p, c_char_p, c_int32, POINTER(c_int64),
       c_int32, c_void_p, c_uint64, c_int32, c_void_p, E)
    fn("ferry_writer_wait_snapshot", I, c_void_p, E)
    fn("ferry_writer_commit_async", I, c_void_p, POINTER(c_void_p), E)
    fn("ferry_save_wait", I, c_void_p, E)
    fn("ferry_save_done", ctypes.c_int, c_void_p)
    fn("ferry_save_free", None, c_void_p)
    fn("ferry_staging_pool_create", I, c_uint64, c_int32, POINTER(c_void_p), E)
    fn("ferry_staging_pool_bytes", c_uint64, c_void_p)
    fn("ferry_staging_pool_free", None, c_void_p)
    fn("ferry_write_shard_index", I, c_char_p, POINTER(c_char_p), c_size_t, POINTER(c_char_p),
       POINTER(c_char_p), c_size_t, E)
    fn("ferry_writer_abort", None, c_void_p)
    fn("ferry_writer_free", None, c_void_p)

    fn("ferry_reader_options_init", None, POINTER(ReaderOptions))
    fn("ferry_reader_open", I, c_char_p, POINTER(ReaderOptions), POINTER(c_void_p), E)
    fn("ferry_reader_free", None, c_void_p)
    fn("ferry_reader_path", c_char_p, c_void_p)
    fn("ferry_reader_file_size", c_uint64, c_void_p)
    fn("ferry_reader_format_version", c_uint32, c_void_p)
    fn("ferry_reader_producer", c_char_p, c_void_p)
    fn("ferry_reader_num_tensors", c_size_t, c_void_p)
    fn("ferry_reader_tensor_info", I, c_void_p, c_size_t, POINTER(TensorInfo), E)
    fn("ferry_reader_find_tensor", I, c_void_p, c_char_p, POINTER(TensorInfo), E)
    fn("ferry_reader_tensor_table", I, c_void_p, POINTER(TensorTable), E)
    fn("ferry_reader_num_metadata", c_size_t, c_void_p)
    fn("ferry_reader_metadata_at", I, c_void_p, c_size_t, POINTER(c_char_p), POINTER(c_char_p),
       E)
    fn("ferry_reader_metadata_get", I, c_void_p, c_char_p, POINTER(c_char_p), E)
    fn("ferry_reader_metadata_entry", I, c_void_p, c_size_t, POINTER(c_void_p), POINTER(c_size_t),
       POINTER(c_void_p), POINTER(c_size_t), E)
    fn("ferry_reader_num_scaling_states", c_size_t, c_void_p)
    fn("ferry_reader_scaling_state_at", I, c_void_p, c_size_t, POINTER(ScalingState), E)
    fn("ferry_reader_view", I, c_void_p, c_char_p, c_uint32, POINTER(c_void_p), E)
    fn("ferry_reader_view_file", I, c_void_p, POINTER(c_void_p), E)
    fn("ferry_reader_read_into", I, c_void_p, c_char_p, c_void_p, c_uint64, c_uint32, E)
    fn("ferry_reader_read_rows_into", I, c_void_p, c_char_p, c_int64, c_int64, c_void_p,
       c_uint64, c_uint32, E)
    fn("ferry_reader_verify", I, c_void_p, c_char_p, E)

    fn("ferry_loader_options_init", None, POINTER(LoaderOptions))
    fn("ferry_cuda_available", I)
    fn("ferry_loader_create", I, POINTER(LoaderOptions), POINTER(c_void_p), E)
    fn("ferry_loader_free", None, c_void_p)
    for name in ("ferry_loader_load_async", "ferry_loader_load"):
        fn(name, I, c_void_p, c_void_p, POINTER(LoadRequest), c_size_t, c_void_p,
           POINTER(c_void_p), c_void_p, E)
    fn("ferry_loader_load_to_host", I, c_void_p, c_void_p, POINTER(LoadRequest), c_size_t,
       POINTER(c_void_p), E)
    fn("ferry_loader_load_to_host_streaming", I, c_void_p, c_void_p, POINTER(LoadRequest),
       c_size_t, READY_FN, c_void_p, POINTER(c_void_p), E)
    for name in ("ferry_loader_load_packed_async", "ferry_loader_load_packed"):
        fn(name, I, c_void_p, c_void_p, c_void_p, c_uint64, c_void_p, E)
    fn("ferry_loader_load_to_host_packed", I, c_void_p, c_void_p, c_void_p, c_uint64, E)
    fn("ferry_loader_load_packed_streaming", I, c_void_p, c_void_p, c_void_p, c_uint64, c_int32,
       READY_FN, c_void_p, c_void_p, E)

    fn("ferry_sharded_open", I, c_char_p, POINTER(ReaderOptions), POINTER(c_void_p), E)
    fn("ferry_sharded_free", None, c_void_p)
    fn("ferry_sharded_num_shards", c_size_t, c_void_p)
    fn("ferry_sharded_shard", I, c_void_p, c_size_t, POINTER(c_void_p), E)
    fn("ferry_split_plan", I, POINTER(PlanItem), c_size_t, c_int32, c_int32, POINTER(PlanPiece),
       c_size_t, POINTER(c_size_t), E)
    fn("ferry_sharded_from_reader", I, c_void_p, POINTER(c_void_p), E)
    fn("ferry_sharded_save_options_init", None, POINTER(ShardedSaveOptions))
    fn("ferry_sharded_save_begin", I, c_char_p, POINTER(ShardedSaveOptions), POINTER(c_void_p), E)
    fn("ferry_sharded_save_writer", c_void_p, c_void_p)
    fn("ferry_sharded_save_shard_path", c_char_p, c_void_p)
    for name in ("ferry_sharded_save_commit", "ferry_sharded_save_commit_async",
                 "ferry_sharded_save_finish"):
        fn(name, I, c_void_p, E)
    fn("ferry_sharded_save_shard_done", I, c_void_p)
    fn("ferry_sharded_save_free", None, c_void_p)
    fn("ferry_dist_plan_options_init", None, POINTER(DistPlanOptions))
    fn("ferry_dist_plan_create", I, c_void_p, POINTER(LoadRequest), c_size_t,
       POINTER(DistPlanOptions), POINTER(c_void_p), E)
    fn("ferry_dist_plan_view", I, c_void_p, POINTER(DistPlanView), E)
    fn("ferry_dist_plan_conclude", I, c_void_p, c_int32, E)
    fn("ferry_dist_plan_free", None, c_void_p)


def call(name, *args):
    """Calls a status-returning C function with a trailing error struct; raises on failure."""
    err = Error()
    code = getattr(lib(), name)(*args, ctypes.byref(err))
    if code != OK:
        raise_error(code, err)


def text(s, what):
    """UTF-8 bytes of str `s` for a C string, which would end at a NUL byte."""
    if "\0" in s:
        raise ValueError("tensorferry: %s %r contains a NUL byte" % (what, s))
    return s.encode("utf-8")


def decode(b, path, what):
    """str of UTF-8 bytes read from a file; DataLossError naming the file when they are not."""
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError as e:
        where = os.fsdecode(path) + ": " if path is not None else ""
        raise DataLossError(DATA_LOSS, "%s%s %r is not valid UTF-8 (byte %d)"
                            % (where, what, b, e.start)) from None


def encode(s):
    if isinstance(s, bytes):
        return s
    return os.fsencode(s) if isinstance(s, os.PathLike) else str(s).encode("utf-8")


def writer_options(encoding, zstd_level=None, threads=0, durable=True, block_size=None,
                   min_savings=None, producer=None):
    """A filled ferry_writer_options_t (the library's defaults where an argument is None).
    The structure holds the producer bytes itself, so it stays valid as long as it lives."""
    opts = WriterOptions()
    lib().ferry_writer_options_init(ctypes.byref(opts))
    opts.encoding = encoding_code(encoding)
    if zstd_level is not None:
        opts.zstd_level = int(zstd_level)
    if block_size is not None:
        opts.block_size = int(block_size)
    if min_savings is not None:
        opts.min_savings = float(min_savings)
    opts.threads = int(threads)
    opts.durable = 1 if durable else 0
    opts.producer = text(producer, "producer") if producer else None
    return opts


def storage_bytes(dtype_code, numel):
    """Bytes `numel` elements of a dtype occupy (ferry_dtype_storage_bytes: FP4 packs two per
    byte)."""
    n = c_uint64()
    call("ferry_dtype_storage_bytes", dtype_code, int(numel), ctypes.byref(n))
    return n.value


def packed_size(nbytes):
    """`nbytes` rounded up to PACKED_ALIGNMENT: the room a tensor takes in a packed buffer."""
    return (nbytes + PACKED_ALIGNMENT - 1) // PACKED_ALIGNMENT * PACKED_ALIGNMENT
