"""tensorferry.convert: PyTorch checkpoints (and safetensors) into TensorFerry files.

The conversion runs in the library (the C API's ferry_convert), so PyTorch pickles are read
by its restricted interpreter and never by Python's pickle module: this module imports
neither pickle nor torch.
"""

import ctypes

from . import _lib


def convert(src, dst, *, to=None, encoding="raw", zstd_level=None, block_size=None, threads=0,
            durable=True, producer=None):
    """Converts `src` into `dst`, atomically.

    src: a torch.save file (.pt, .bin), a sharded pytorch_model.bin.index.json, a PyTorch
    Distributed Checkpoint folder, a safetensors file or a TensorFerry checkpoint. Only
    tensors, plain values (kept as metadata) and TransformerEngine ``_extra_state`` (kept as
    the checkpoint's FP8 scaling state) are imported; any other pickled object is refused with
    an error naming it. Nothing in the pickles is executed, and CUDA tensors are read without
    touching a GPU.

    The output format is `to` ("ferry" or "safetensors") or else dst's extension: a
    ``.safetensors`` name writes safetensors (PyTorch inputs without FP8 scaling state), a
    ``.ferry`` name a TensorFerry checkpoint with `encoding` ("raw", "zstd", "shuffle+zstd" or
    "shuffle_zstd", "planes"). Any other name (model.pt, pytorch_model.bin, a typo such as
    model.safetensor) raises InvalidArgumentError unless `to` says which format it gets.
    """
    opts = _lib.writer_options(encoding, zstd_level, threads, durable, block_size,
                               producer=producer)
    _lib.call("ferry_convert_to", _fspath(src), _fspath(dst),
              None if to is None else _lib.encode(to), ctypes.byref(opts))


def _fspath(p):
    import os

    return os.fsencode(os.fspath(p))
