"""torch.save-format checkpoints built without torch, for tests of the importer.

torch is not installable everywhere the tests run, so this module writes the same bytes
torch.save writes for plain state dicts: a zip archive "<root>/data.pkl" (protocol 2 pickle
whose tensors are torch._utils._rebuild_tensor_v2/_v3 calls over persistent ids
("storage", torch.<X>Storage, key, location, numel)), "<root>/data/<key>" (raw little-endian
storage bytes, stored uncompressed), "<root>/byteorder" and "<root>/version".

The pickles are made by Python's own pickle module, with stand-in objects whose module and
qualified names are torch's (and TransformerEngine's), registered in sys.modules only while a
pickle is being written (see `fake_modules`). tests/data/torch/make_fixtures.py writes the
same kinds of checkpoints with the real torch.
"""

import collections
import contextlib
import dataclasses
import enum
import io
import pickle
import struct
import sys
import types
import typing
import zipfile

import numpy as np

# torch dtype name -> (numpy dtype or None, legacy storage class or None, itemsize)
DTYPES = {
    "float32": (np.float32, "FloatStorage", 4),
    "float64": (np.float64, "DoubleStorage", 8),
    "float16": (np.float16, "HalfStorage", 2),
    "bfloat16": (None, "BFloat16Storage", 2),
    "int8": (np.int8, "CharStorage", 1),
    "int16": (np.int16, "ShortStorage", 2),
    "int32": (np.int32, "IntStorage", 4),
    "int64": (np.int64, "LongStorage", 8),
    "uint8": (np.uint8, "ByteStorage", 1),
    "bool": (np.bool_, "BoolStorage", 1),
    "complex64": (np.complex64, "ComplexFloatStorage", 8),
    "complex128": (np.complex128, "ComplexDoubleStorage", 16),
    "uint16": (np.uint16, None, 2),
    "uint32": (np.uint32, None, 4),
    "uint64": (np.uint64, None, 8),
    "float8_e4m3fn": (None, None, 1),
    "float8_e5m2": (None, None, 1),
    "float8_e4m3fnuz": (None, None, 1),
    "float8_e5m2fnuz": (None, None, 1),
    "float8_e8m0fnu": (None, None, 1),
    "float4_e2m1fn_x2": (None, None, 1),
    "complex32": (None, None, 4),
}


def _module(name, **attrs):
    m = types.ModuleType(name)
    for k, v in attrs.items():
        if isinstance(v, types.FunctionType) or isinstance(v, type):
            v.__module__ = name
            v.__qualname__ = k
            v.__name__ = k
        setattr(m, k, v)
    return m


class _DType:
    def __init__(self, name):
        self.name = name

    def __reduce__(self):
        return self.name


_DType.__module__ = "torch"


class _Layout:
    """torch.layout: pickled as torch.serialization._get_layout(<name>)."""

    def __init__(self, name):
        self.name = name

    def __reduce__(self):
        return (_FAKES["torch.serialization"]._get_layout, (self.name,))


def _fn(name):
    def f(*a):
        raise AssertionError("stand-in %s must never be called" % name)
    return f


def _build_fakes():
    torch = _module("torch")
    for name in DTYPES:
        setattr(torch, name, _DType(name))
    storages = {}
    for name, (_, storage, _) in DTYPES.items():
        if storage:
            storages[storage] = type(storage, (), {})
    storages["UntypedStorage"] = type("UntypedStorage", (), {})
    for k, cls in storages.items():
        cls.__module__ = "torch"
        cls.__qualname__ = k
        setattr(torch, k, cls)
    class Size(tuple):
        def __reduce__(self):
            return (Size, (tuple(self),))

    Size.__module__ = "torch"
    Size.__qualname__ = "Size"
    torch.Size = Size
    torch.strided = _DType("strided")
    utils = _module("torch._utils", _rebuild_tensor_v2=_fn("v2"), _rebuild_tensor_v3=_fn("v3"),
                    _rebuild_parameter=_fn("param"), _rebuild_tensor=_fn("v1"))
    storage_mod = _module("torch.storage", _load_from_bytes=_fn("_load_from_bytes"))
    serialization = _module("torch.serialization", _get_layout=_fn("_get_layout"))
    torch.serialization = serialization
    torch._utils = utils
    torch.storage = storage_mod
    recipe = _te_recipe_module()
    te = _module("transformer_engine")
    te_common = _module("transformer_engine.common")
    te.common = te_common
    te_common.recipe = recipe
    dcp = _dcp_modules()
    osmod = sys.modules["os"]
    return {**dcp, "torch": torch, "torch._utils": utils, "torch.storage": storage_mod,
            "torch.serialization": serialization,
            "transformer_engine": te, "transformer_engine.common": te_common,
            "transformer_engine.common.recipe": recipe, "os": osmod}


def _dcp_modules():
    meta = types.ModuleType("torch.distributed.checkpoint.metadata")
    fsm = types.ModuleType("torch.distributed.checkpoint.filesystem")

    class _MEM_FORMAT_ENCODING(enum.Enum):
        TORCH_CONTIGUOUS_FORMAT = 0
        TORCH_CHANNELS_LAST = 1
        TORCH_PRESERVE_FORMAT = 2

    @dataclasses.dataclass
    class ChunkStorageMetadata:
        offsets: tuple
        sizes: tuple

    @dataclasses.dataclass
    class TensorProperties:
        dtype: object = None

        def __getstate__(self):
            return (self.dtype, _Layout("torch.strided"), False,
                    _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT, False)

        def __setstate__(self, state):
            self.dtype = state[0]

    @dataclasses.dataclass
    class TensorStorageMetadata:
        properties: TensorProperties
        size: tuple
        chunks: list

    @dataclasses.dataclass
    class BytesStorageMetadata:
        pass

    @dataclasses.dataclass(frozen=True)
    class MetadataIndex:
        fqn: str
        offset: object = None
        index: object = dataclasses.field(hash=False, compare=False, default=None)

    @dataclasses.dataclass
    class Metadata:
        state_dict_metadata: dict
        planner_data: object = None
        storage_data: object = None
        storage_meta: object = None

    @dataclasses.dataclass
    class _StorageInfo:
        relative_path: str
        offset: int
        length: int
        transform_descriptors: object = None

    for m, classes in ((meta, (_MEM_FORMAT_ENCODING, ChunkStorageMetadata, TensorProperties,
                               TensorStorageMetadata, BytesStorageMetadata, MetadataIndex,
                               Metadata)), (fsm, (_StorageInfo,))):
        for cls in classes:
            cls.__module__ = m.__name__
            cls.__qualname__ = cls.__name__
            setattr(m, cls.__name__, cls)
    return {"torch.distributed.checkpoint.metadata": meta,
            "torch.distributed.checkpoint.filesystem": fsm}


def _te_recipe_module():
    m = types.ModuleType("transformer_engine.common.recipe")

    class _FormatHelper(typing.NamedTuple):
        max_fwd: float
        max_bwd: float

    class Format(enum.Enum):
        E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
        E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
        HYBRID = _FormatHelper(max_fwd=E4M3.max_fwd, max_bwd=E5M2.max_bwd)

    class _OverrideLinearPrecision(typing.NamedTuple):
        fprop: bool = False
        dgrad: bool = False
        wgrad: bool = False

    @dataclasses.dataclass
    class DelayedScaling:
        margin: int = 0
        fp8_format: Format = Format.HYBRID
        amax_history_len: int = 1024
        amax_compute_algo: str = "max"
        override_linear_precision: _OverrideLinearPrecision = _OverrideLinearPrecision()
        scaling_factor_compute_algo: object = None
        reduce_amax: bool = True
        fp8_dpa: bool = False
        fp8_mha: bool = False

    @dataclasses.dataclass
    class Float8CurrentScaling:
        fp8_format: Format = Format.HYBRID
        fp8_dpa: bool = False
        fp8_mha: bool = False

    @dataclasses.dataclass
    class MXFP8BlockScaling:
        margin: int = 0
        fp8_format: Format = Format.E4M3

    @dataclasses.dataclass
    class Float8BlockScaling:
        fp8_format: Format = Format.E4M3
        x_block_scaling_dim: int = 1
        w_block_scaling_dim: int = 2
        grad_block_scaling_dim: int = 1

    @dataclasses.dataclass
    class NVFP4BlockScaling:
        disable_rht: bool = False
        disable_stochastic_rounding: bool = False
        disable_2d_quantization: bool = False

    for cls in (_FormatHelper, Format, _OverrideLinearPrecision, DelayedScaling,
                Float8CurrentScaling, MXFP8BlockScaling, Float8BlockScaling, NVFP4BlockScaling):
        cls.__module__ = m.__name__
        cls.__qualname__ = cls.__name__
        setattr(m, cls.__name__, cls)
    return m


_FAKES = _build_fakes()
recipe = _FAKES["transformer_engine.common.recipe"]
torch = _FAKES["torch"]


@contextlib.contextmanager
def fake_modules():
    """Registers the stand-in modules while pickles are written; restores sys.modules."""
    saved = {k: sys.modules.get(k) for k in _FAKES}
    try:
        for k, v in _FAKES.items():
            sys.modules[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


class Storage:
    """Raw bytes of one storage, named by `key`, viewed as `dtype` elements."""

    def __init__(self, data, dtype, key=None, location="cpu", untyped=False):
        self.data = bytes(data)
        self.dtype = dtype
        self.key = key
        self.location = location
        self.untyped = untyped or DTYPES[dtype][1] is None


class Tensor:
    """torch._utils._rebuild_tensor_v2 (or v3 for dtypes without a legacy storage class)."""

    def __init__(self, storage, shape, stride=None, offset=0):
        self.storage = storage
        self.shape = tuple(shape)
        if stride is None:
            stride, acc = [], 1
            for d in reversed(self.shape):
                stride.insert(0, acc)
                acc *= d
        self.stride = tuple(stride)
        self.offset = offset

    def __reduce_ex__(self, protocol):
        s = self.storage
        hooks = collections.OrderedDict()
        if s.untyped:
            return (torch._utils._rebuild_tensor_v3,
                    (s, self.offset, self.shape, self.stride, False, hooks,
                     getattr(torch, s.dtype)))
        return (torch._utils._rebuild_tensor_v2,
                (s, self.offset, self.shape, self.stride, False, hooks))


def tensor(array, dtype=None, location="cpu"):
    """A contiguous Tensor holding a numpy array (its own storage)."""
    a = np.ascontiguousarray(array)
    dtype = dtype or a.dtype.name
    return Tensor(Storage(a.tobytes(), dtype, location=location), a.shape)


class _Pickler(pickle.Pickler):
    def __init__(self, f, storages, protocol):
        super().__init__(f, protocol=protocol)
        self.storages = storages

    def persistent_id(self, obj):
        if isinstance(obj, Storage):
            if obj.key is None:
                obj.key = str(len(self.storages))
            if obj.key not in self.storages:
                self.storages[obj.key] = obj
            itemsize = DTYPES[obj.dtype][2]
            if obj.untyped:
                return ("storage", torch.UntypedStorage, obj.key, obj.location, len(obj.data))
            return ("storage", getattr(torch, DTYPES[obj.dtype][1]), obj.key, obj.location,
                    len(obj.data) // itemsize)
        return None


def torch_save_bytes(obj, root="archive", protocol=2, entries=None):
    """The bytes torch.save(obj) writes (for the plain objects above)."""
    storages = {}
    buf = io.BytesIO()
    with fake_modules():
        _Pickler(buf, storages, protocol).dump(obj)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        z.writestr(root + "/data.pkl", buf.getvalue())
        z.writestr(root + "/byteorder", b"little")
        for key, s in storages.items():
            z.writestr(root + "/data/" + key, s.data)
        z.writestr(root + "/version", b"3\n")
        for name, data in (entries or {}).items():
            z.writestr(root + "/" + name, data)
    return out.getvalue()


def torch_save(obj, path, **kw):
    with open(path, "wb") as f:
        f.write(torch_save_bytes(obj, **kw))


# ---- plain pickle of tensors (what pickle.dumps does to a torch tensor) ------------------

_LEGACY_MAGIC = 0x1950a86a20f9469cfc6c


class _LegacyPickler(pickle.Pickler):
    def __init__(self, f, storage):
        super().__init__(f, protocol=2)
        self.storage = storage

    def persistent_id(self, obj):
        if obj is self.storage:
            s = obj
            return ("storage", getattr(torch, DTYPES[s.dtype][1]), "0", s.location,
                    len(s.data) // DTYPES[s.dtype][2], None)
        return None


def legacy_storage_bytes(storage):
    """torch.save(storage, f, _use_new_zipfile_serialization=False) of one typed storage."""
    f = io.BytesIO()
    for part in (_LEGACY_MAGIC, 1001,
                 {"protocol_version": 1001, "little_endian": True,
                  "type_sizes": {"short": 2, "int": 4, "long": 4}}):
        pickle.dump(part, f, protocol=2)
    with fake_modules():
        _LegacyPickler(f, storage).dump(storage)
    pickle.dump(["0"], f, protocol=2)
    f.write(struct.pack("<q", len(storage.data) // DTYPES[storage.dtype][2]))
    f.write(storage.data)
    return f.getvalue()


class PlainStorage(Storage):
    """A storage as plain pickle writes it: torch.storage._load_from_bytes(<legacy bytes>)."""

    def __reduce_ex__(self, protocol):
        return (torch.storage._load_from_bytes, (legacy_storage_bytes(self),))


def plain_tensor(array, location="cpu"):
    a = np.ascontiguousarray(array)
    return Tensor(PlainStorage(a.tobytes(), a.dtype.name, location=location), a.shape)


def plain_pickle(obj, protocol=4):
    """pickle.dumps(obj) with the stand-ins (what TransformerEngine 2.x stores)."""
    with fake_modules():
        return pickle.dumps(obj, protocol=protocol)


# ---- TransformerEngine extra state, each version --------------------------------------------

def te_state(recipe_obj, num_gemms=1, history=4, seed=0, make=None):
    """The dict TransformerEngine's get_extra_state pickles."""
    make = make or tensor
    rng = np.random.default_rng(seed)
    sf, sb = 3 * num_gemms, 2 * num_gemms
    state = {"recipe": recipe_obj,
             "scale_fwd": make(rng.random(sf, dtype=np.float32)),
             "amax_history_fwd": make(rng.random((history, sf), dtype=np.float32)),
             "scale_bwd": make(rng.random(sb, dtype=np.float32)),
             "amax_history_bwd": make(rng.random((history, sb), dtype=np.float32)),
             "extra_fp8_variables": {"num_gemms": num_gemms, "fp8_checkpoint": True,
                                     "fp8_max_fwd": 448.0}}
    arrays = {k: np.frombuffer(v.storage.data, np.float32).reshape(v.shape)
              for k, v in state.items() if isinstance(v, Tensor)}
    return state, arrays


def uint8_tensor(data):
    return tensor(np.frombuffer(bytes(data), np.uint8).copy())


# ---- PyTorch Distributed Checkpoint folders ---------------------------------------------------

def dcp_save(state_dict, directory, chunks=None):
    """What torch.distributed.checkpoint.save writes from one process: `.metadata` (a pickled
    Metadata) and `__0_0.distcp` holding one torch.save archive per tensor. `chunks` maps a
    name to a list of (offsets, Tensor) to describe a tensor saved in several chunks."""
    import os

    meta = _FAKES["torch.distributed.checkpoint.metadata"]
    fsm = _FAKES["torch.distributed.checkpoint.filesystem"]
    Size = torch.Size
    os.makedirs(directory, exist_ok=True)
    data = io.BytesIO()
    sdm, storage = {}, {}
    for name, t in state_dict.items():
        parts = (chunks or {}).get(name) or [((0,) * len(t.shape), t)]
        cms = []
        for offsets, part in parts:
            blob = torch_save_bytes(part, root="archive")
            info = fsm._StorageInfo("__0_0.distcp", data.tell(), len(blob))
            data.write(blob)
            storage[meta.MetadataIndex(name, Size(offsets), len(cms))] = info
            cms.append(meta.ChunkStorageMetadata(Size(offsets), Size(part.shape)))
        sdm[name] = meta.TensorStorageMetadata(
            meta.TensorProperties(getattr(torch, t.storage.dtype)), Size(t.shape), cms)
    with open(os.path.join(directory, "__0_0.distcp"), "wb") as f:
        f.write(data.getvalue())
    md = meta.Metadata(state_dict_metadata=sdm, planner_data={}, storage_data=storage)
    with fake_modules():
        blob = pickle.dumps(md, protocol=4)
    with open(os.path.join(directory, ".metadata"), "wb") as f:
        f.write(blob)
