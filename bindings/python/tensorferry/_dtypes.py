"""ferry dtypes and their numpy (+ ml_dtypes) and torch counterparts.

Storage rules the conversions follow (schema/ferry.fbs):
- F6_*: one element per byte, value in the low 6 bits. ml_dtypes stores them the same way.
- F4_E2M1FN: two elements per byte, element 2i in the low nibble of byte i. ml_dtypes keeps
  one element per byte, so numpy arrays are packed on save and unpacked on load (a copy);
  torch's float4_e2m1fn_x2 packs pairs along the last dimension the same way.
"""

_codes = _names = None


def _tables():
    """({name: code}, [name by code]) of every ferry dtype, as the library names them."""
    global _codes, _names
    if _codes is None:
        from . import _lib

        lib = _lib.lib()
        names = []
        while True:
            name = lib.ferry_dtype_name(len(names)).decode()
            if name == "?":  # past the last code
                break
            names.append(name)
        _codes, _names = {n: c for c, n in enumerate(names)}, names
    return _codes, _names


def code(name):
    """The ferry dtype code of a dtype name ("BF16" -> 10)."""
    return _tables()[0][name]


def name(code):
    """The ferry dtype name of a code."""
    return _tables()[1][code]


# numpy's own dtypes (numpy's DLPack import knows these).
_NUMPY_NATIVE = {
    "BOOL": "bool", "U8": "uint8", "U16": "uint16", "U32": "uint32", "U64": "uint64",
    "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64", "F16": "float16",
    "F32": "float32", "F64": "float64", "C64": "complex64", "C128": "complex128",
}
# ml_dtypes attribute names.
_ML_DTYPES = {
    "BF16": "bfloat16", "F8_E4M3FN": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E8M0FNU": "float8_e8m0fnu", "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "F6_E2M3FN": "float6_e2m3fn",
    "F6_E3M2FN": "float6_e3m2fn", "F4_E2M1FN": "float4_e2m1fn",
}
# torch attribute names; F6 has no torch dtype and travels as uint8.
_TORCH = {
    "BOOL": "bool", "U8": "uint8", "U16": "uint16", "U32": "uint32", "U64": "uint64",
    "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64", "F16": "float16",
    "BF16": "bfloat16", "F32": "float32", "F64": "float64", "C64": "complex64",
    "C128": "complex128", "F8_E4M3FN": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E8M0FNU": "float8_e8m0fnu", "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "F6_E2M3FN": "uint8", "F6_E3M2FN": "uint8",
    "F4_E2M1FN": "float4_e2m1fn_x2",
}


def numpy_native(name):
    return name in _NUMPY_NATIVE


def to_numpy(name):
    """The numpy dtype of a ferry dtype name (ml_dtypes for bf16 and the narrow floats)."""
    import numpy as np

    if name in _NUMPY_NATIVE:
        return np.dtype(_NUMPY_NATIVE[name])
    try:
        import ml_dtypes
    except ImportError:
        raise ImportError(
            "tensorferry: %s tensors in numpy need ml_dtypes (pip install ml_dtypes)" % name
        ) from None
    attr = getattr(ml_dtypes, _ML_DTYPES[name], None)
    if attr is None:
        raise TypeError("tensorferry: this ml_dtypes has no %s" % _ML_DTYPES[name])
    return np.dtype(attr)


def from_numpy(dtype):
    """The ferry dtype name of a numpy dtype; TypeError when there is none."""
    import numpy as np

    dtype = np.dtype(dtype)
    for name, np_name in _NUMPY_NATIVE.items():
        if dtype == np.dtype(np_name):
            return name
    try:
        import ml_dtypes
    except ImportError:
        ml_dtypes = None
    if ml_dtypes is not None:
        for name, attr in _ML_DTYPES.items():
            t = getattr(ml_dtypes, attr, None)
            if t is not None and dtype == np.dtype(t):
                return name
    raise TypeError("tensorferry: no checkpoint dtype for numpy dtype %s" % dtype)


def to_torch(name):
    import torch

    t = getattr(torch, _TORCH[name], None)
    if t is None:
        # Older torch without uint16/32/64 or float8_e8m0fnu / float4 dtypes: raw bytes.
        return None
    return t


def from_torch(dtype):
    """The ferry dtype name of a torch dtype; TypeError when there is none."""
    import torch

    for name, attr in _TORCH.items():
        if attr == "uint8" and name != "U8":
            continue
        t = getattr(torch, attr, None)
        if t is not None and t == dtype:
            return name
    raise TypeError("tensorferry: no checkpoint dtype for torch dtype %s" % dtype)


def pack_fp4(codes):
    """Packs uint8 nibble codes (one per element) two per byte, element 2i low."""
    import numpy as np

    flat = np.ascontiguousarray(codes, dtype=np.uint8).reshape(-1) & 0x0F
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.uint8)])
    return (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8)


def unpack_fp4(packed, numel):
    import numpy as np

    packed = np.asarray(packed, dtype=np.uint8).reshape(-1)
    out = np.empty(packed.size * 2, np.uint8)
    out[0::2] = packed & 0x0F
    out[1::2] = packed >> 4
    return out[:numel]
