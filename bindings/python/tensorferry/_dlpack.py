"""DLPack producer over the C API's DLManagedTensorVersioned, in pure ctypes.

`DLPackTensor` implements ``__dlpack__`` / ``__dlpack_device__``, so ``numpy.from_dlpack``,
``torch.from_dlpack``, ``cupy.from_dlpack`` and ``jax.dlpack.from_dlpack`` take it without a
copy. Consumers that pass ``max_version >= (1, 0)`` get a "dltensor_versioned" capsule (which
carries the read-only flag); older consumers get a legacy "dltensor" capsule.
"""

import ctypes

from . import _lib

_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def _static_cstring(text):
    # A capsule keeps the name pointer it was created with, and capsules can outlive this
    # module (interpreter shutdown): the names live in memory that is never freed.
    buf = ctypes.create_string_buffer(text)
    _api.Py_IncRef(ctypes.py_object(buf))
    return ctypes.cast(buf, ctypes.c_char_p)


_NAME_VERSIONED = _static_cstring(b"dltensor_versioned")
_NAME_LEGACY = _static_cstring(b"dltensor")


def _capsule(ptr, name):
    # The destructor is C (ferry_dlpack_capsule_destructor): it runs when a consumer refuses
    # the tensor with its exception pending, which a ctypes callback cannot survive.
    destructor = ctypes.cast(_lib.lib().ferry_dlpack_capsule_destructor, ctypes.c_void_p)
    return _api.PyCapsule_New(ptr, name, destructor)


class DLPackTensor:
    """Owns one DLManagedTensorVersioned until a consumer takes it through ``__dlpack__``.

    A DLPackTensor can be exported once. ``shape``, ``dtype`` (a ferry dtype name),
    ``device`` and ``readonly`` describe it without exporting.
    """

    __slots__ = ("_ptr", "_managed", "ferry_dtype", "__weakref__")

    def __init__(self, ptr, ferry_dtype):
        self._ptr = ptr
        self._managed = ctypes.cast(ptr, ctypes.POINTER(_lib.DLManagedTensorVersioned)).contents
        self.ferry_dtype = ferry_dtype

    def __del__(self):
        ptr, self._ptr = getattr(self, "_ptr", None), None
        if ptr:
            _lib.lib().ferry_dlpack_free(ptr)

    def _check(self):
        if not self._ptr:
            raise BufferError("tensorferry: this DLPack tensor was already exported")

    @property
    def shape(self):
        self._check()
        t = self._managed.dl_tensor
        return tuple(t.shape[i] for i in range(t.ndim))

    @property
    def data_ptr(self):
        self._check()
        return self._managed.dl_tensor.data or 0

    @property
    def readonly(self):
        self._check()
        return bool(self._managed.flags & _lib.DLPACK_FLAG_BITMASK_READ_ONLY)

    @property
    def dl_dtype(self):
        self._check()
        d = self._managed.dl_tensor.dtype
        return (d.code, d.bits, d.lanes)

    def __dlpack_device__(self):
        self._check()
        dev = self._managed.dl_tensor.device
        return (dev.device_type, dev.device_id)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        # `stream` needs no handling: device tensors are handed out only once their copies
        # are complete (or ordered on the caller's stream by the caller's own request).
        self._check()
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise BufferError("tensorferry: cannot export to another device without a copy")
        if copy:
            raise BufferError("tensorferry: copy=True is not supported; copy after import")
        ptr = self._ptr
        if max_version is not None and tuple(max_version)[0] >= 1:
            capsule = _capsule(ptr, _NAME_VERSIONED)
            self._ptr = None
            return capsule
        if self.readonly:
            # A legacy consumer would take the view as writable and fault on the first write
            # into the read-only file mapping.
            raise BufferError(
                "tensorferry: a read-only view needs a DLPack 1.x consumer (numpy >= 2, "
                "torch >= 2.4)")
        legacy = ctypes.c_void_p()
        _lib.call("ferry_dlpack_to_legacy", ptr, ctypes.byref(legacy))
        self._ptr = None
        return _capsule(legacy.value, _NAME_LEGACY)

    def __repr__(self):
        if not self._ptr:
            return "DLPackTensor(<exported>)"
        return "DLPackTensor(shape=%r, dtype=%s, device=%r)" % (
            self.shape, self.ferry_dtype, self.__dlpack_device__())


class HostBuffer:
    """Exposes a host DLPackTensor's bytes to numpy through ``__array_interface__`` (for dtypes
    numpy's DLPack import does not know, such as bfloat16 and FP8); keeps it alive."""

    __slots__ = ("_tensor", "__array_interface__")

    def __init__(self, tensor, nbytes):
        self._tensor = tensor
        self.__array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (tensor.data_ptr, tensor.readonly),
            "version": 3,
        }
