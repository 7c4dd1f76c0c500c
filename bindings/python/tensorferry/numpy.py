"""numpy arrays in and out, in the shape of ``safetensors.numpy``.

    import tensorferry.numpy as tfn
    tfn.save_file({"w": array}, "model.ferry", metadata={"step": "10"})
    arrays = tfn.load_file("model.ferry")       # {name: numpy.ndarray}
    data = tfn.save({"w": array})               # bytes of a checkpoint
    arrays = tfn.load(data)

Same calls and results as safetensors.numpy. Where TensorFerry differs, on purpose:
- the file is TensorFerry's format (``ferry convert`` turns it into safetensors and back);
- save_file and save take TensorFerry's options as keywords (encoding="shuffle_zstd", ...);
- bfloat16, FP8, FP6 and FP4 arrays are ml_dtypes arrays;
- errors are tensorferry's types (a missing file is a FileNotFoundError, as in safetensors;
  a malformed one a DataLossError instead of SafetensorError).
"""

import tensorferry as _tf

__all__ = ["save_file", "load_file", "save", "load"]


def save_file(tensor_dict, filename, metadata=None, **options):
    """Writes `tensor_dict` (name -> numpy array) to `filename`, atomically. `options`:
    those of tensorferry.save_file (encoding, zstd_level, durable, scaling_state, ...)."""
    _tf.save_file(tensor_dict, filename, metadata=metadata, **options)


def save(tensor_dict, metadata=None, **options):
    """The checkpoint as bytes."""
    return _tf._save_bytes(tensor_dict, metadata, **options)


def load_file(filename, *, verify=False, threads=0):
    """Every tensor of `filename` as a writable numpy array (raw ones viewing a private
    copy-on-write mapping of the file: a write stays in the array; see
    tensorferry.load_file)."""
    return _tf.load_file(filename, device="cpu", framework="np", verify=verify, threads=threads)


def load(data):
    """Every tensor of a checkpoint given as bytes, as numpy arrays."""
    return _tf._load_bytes(data, load_file)
