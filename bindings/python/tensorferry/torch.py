"""torch integration, in the shape of ``safetensors.torch``, plus FP8 scaling state.

    import tensorferry.torch as tft
    tft.save_file({"w": tensor}, "model.ferry", metadata={"step": "10"})
    tensors = tft.load_file("model.ferry", device="cuda")   # torch tensors, CURRENT device
    tft.save_model(model, "model.ferry")
    missing, unexpected = tft.load_model(model, "model.ferry")   # into the module's tensors
    data = tft.save({"w": tensor}); tensors = tft.load(data)     # bytes

    tft.save_state_dict(model, "ckpt.ferry", scaling_state=fp8_state, metadata={"step": "100"})
    state = tft.load_state_dict("ckpt.ferry", module=model)       # current device, stream
    fp8_state = tft.load_scaling_state("ckpt.ferry")               # tensors on current device

The safetensors-shaped calls take the same arguments and give the same results and errors
as safetensors.torch (tensors that share memory are refused by save_file with a message
naming them; save_model drops duplicate names; load_model is strict or not, returning
(missing, unexpected)). Where TensorFerry differs, on purpose:
- ``device="cuda"`` (or ``torch.device("cuda")``) is the current device,
  ``torch.cuda.current_device()``, never cuda:0; copies run on that device's current stream;
- load_model loads each tensor straight into the module's own tensor, on the device where
  that tensor lives (no copy through the CPU); ``device`` is accepted and ignored;
- save_file stores non-contiguous tensors contiguously (safetensors refuses them);
- save_file and save take TensorFerry's options as keywords (encoding="shuffle_zstd", ...).

Loading targets torch.cuda.current_device() and torch.cuda.current_stream() (or the device
you name); nothing is created on any other GPU. The scaling state is structured data
(tensorferry._scaling): recipe fields, ``scale`` F32[S] and ``amax_history`` F32[L, S] per
direction, stored in the checkpoint's ScalingState tables.
"""

import torch as _torch

import tensorferry as _tf
from tensorferry import _dtypes, _scaling, _state

__all__ = ["save_file", "save_file_async", "load_file", "save", "load", "save_model",
           "load_model", "save_state_dict", "save_state_dict_async", "load_state_dict",
           "load_scaling_state", "recipe_to_dict", "load_te_extra_state"]

recipe_to_dict = _scaling.recipe_to_dict


def _default_device(device):
    if device is not None:
        return device
    return "cuda" if _torch.cuda.is_available() else "cpu"


def save_state_dict(state_dict, path, *, metadata=None, scaling_state=None,
                    extra_state="error", encoding="raw", zstd_level=None, durable=True):
    """Saves a state_dict (or a module's) with its FP8 scaling state.

    A nested state (``{"model": sd, "optimizer": opt.state_dict(), "step": 10}``) is
    flattened as ``ferry convert`` imports the same torch.save file: ``model.weight``,
    ``optimizer.state.0.exp_avg``, and plain values (``step``,
    ``optimizer.param_groups.0.lr``) as metadata text, which
    ``tensorferry.read_metadata(path, typed=True)`` turns back into ints, floats and bools.
    TransformerEngine's pickled ``_extra_state`` entries, and objects that are neither
    tensors nor plain values, are refused (extra_state="error") or left out with a warning
    (extra_state="skip"): pass FP8 state as `scaling_state` instead, so that nothing
    executable or device-bound lands in the file. A state of which nothing would be stored is
    refused. CUDA tensors of the current device are read in place on torch's current stream
    (tensorferry.save_file); they may be reused once this returns.
    """
    tensors, metadata = _tensors(state_dict, extra_state, metadata)
    _tf.save_file(tensors, path, metadata=metadata, encoding=encoding, zstd_level=zstd_level,
                  durable=durable, scaling_state=scaling_state)


def save_state_dict_async(state_dict, path, *, metadata=None, scaling_state=None,
                          extra_state="error", encoding="raw", zstd_level=None, durable=True,
                          staging=None):
    """As save_state_dict, but returns a tensorferry.SaveFuture (wait(), done(), result()) once
    every tensor is snapshotted into host memory; the parameters may then be updated while the
    file is written, fsynced and renamed into place in the background. `staging`: see
    tensorferry.save_file_async."""
    tensors, metadata = _tensors(state_dict, extra_state, metadata)
    return _tf.save_file_async(tensors, path, metadata=metadata, encoding=encoding,
                               zstd_level=zstd_level, durable=durable,
                               scaling_state=scaling_state, staging=staging)


def _tensors(state_dict, extra_state, metadata):
    """(tensors, metadata) to save: the state flattened (tensorferry._state), its plain values
    merged into `metadata`."""
    if isinstance(state_dict, _torch.nn.Module):
        state_dict = state_dict.state_dict()
    if extra_state not in ("error", "skip"):
        raise ValueError("tensorferry: extra_state must be 'error' or 'skip'")

    def pickled_extra_state(name, value):
        if name != "_extra_state" and not name.endswith("._extra_state"):
            return False
        if extra_state == "skip":
            return True
        raise TypeError("tensorferry: state_dict entry %r is pickled extra state; FP8 state "
                        "goes in scaling_state=..., never pickled" % name)

    try:
        tensors, values, dropped = _state.flatten(
            state_dict, lambda v: isinstance(v, _torch.Tensor), set_aside=pickled_extra_state,
            skip_others=extra_state == "skip")
    except TypeError as e:
        raise TypeError("%s. Pass extra_state='skip' to leave such entries out." % e) from None
    if dropped:
        import warnings

        warnings.warn("tensorferry: left out of the checkpoint (extra_state='skip'): %s"
                      % ", ".join(dropped), stacklevel=3)
    if not tensors and not values and dropped:
        # Following the hint must not write an empty checkpoint in place of the state.
        raise ValueError("tensorferry: nothing of the state would be stored: every entry (%s) "
                         "was left out" % ", ".join(dropped))
    merged = dict(metadata or {})
    for key, text in values.items():
        if key in merged and merged[key] != text:
            raise ValueError("tensorferry: metadata %r is also a value of the state (%r)"
                             % (key, text))
        merged[key] = text
    return tensors, merged or metadata


def load_state_dict(path, *, device=None, module=None, strict=True):
    """Loads every tensor onto `device` (default: the current CUDA device if there is one,
    else CPU), on that device's current torch stream. With `module`, also calls
    module.load_state_dict(state, strict=strict). Returns the state dict."""
    state = _tf.load_file(path, device=_default_device(device), framework="pt")
    if module is not None:
        module.load_state_dict(state, strict=strict)
    return state


def load_scaling_state(path, *, device=None):
    """The structured FP8 scaling state with ``scale`` and ``amax_history`` as float32 torch
    tensors on `device` (default: the current CUDA device if there is one, else CPU)."""
    device = _default_device(device)
    if device != "cpu" and not isinstance(device, int) and _torch.device(device).index is None:
        device = _torch.device("cuda", _torch.cuda.current_device())
    state = _tf.read_scaling_state(path)
    for entry in state.values():
        for st in entry["states"]:
            st["scale"] = _torch.from_numpy(st["scale"]).to(device)
            st["amax_history"] = _torch.from_numpy(st["amax_history"]).to(device)
    return state


def load_te_extra_state(path, *, device=None):
    """{"<module>._extra_state": uint8 tensor} for every TransformerEngine module of the
    checkpoint, each in the form the module's set_extra_state accepts (see tensorferry._te),
    built from the checkpoint's scaling-state tables on `device` (default: the current CUDA
    device if there is one, else CPU). Merge it into a state dict before
    module.load_state_dict."""
    import pickle

    from tensorferry import _te

    device = _default_device(device)
    metadata = _tf.read_metadata(path)
    out = {}
    for module, entry in _tf.read_scaling_state(path).items():
        state = _te.extra_state_dict(entry, _te.extra_fp8_variables(metadata, module),
                                     to_tensor=lambda a: _torch.from_numpy(a.copy()))
        if state is None:
            blob = _torch.empty(0, dtype=_torch.uint8)
        else:
            recipe = _te.recipe_object(entry["recipe"])
            if recipe is not None:
                state["recipe"] = recipe
            blob = _torch.frombuffer(bytearray(pickle.dumps(state)), dtype=_torch.uint8)
        out[(module + "." if module else "") + "_extra_state"] = blob.to(device)
    return out


# ---- safetensors.torch-shaped calls -----------------------------------------------------


def _check_tensors(tensors):
    if not isinstance(tensors, dict):
        raise ValueError("Expected a dict of [str, torch.Tensor] but received %s"
                         % type(tensors))
    for name, value in tensors.items():
        if not isinstance(value, _torch.Tensor):
            raise ValueError("Key `%s` is invalid, expected torch.Tensor but received %s"
                             % (name, type(value)))
        if value.layout != _torch.strided:
            raise ValueError("tensorferry: %r is a sparse tensor; only dense tensors are "
                             "stored (.to_dense() first)" % name)


def save_file(tensors, filename, metadata=None, **options):
    """Writes `tensors` (name -> torch.Tensor, CPU or CUDA) to `filename`, atomically.
    `options`: those of tensorferry.save_file (encoding, zstd_level, durable, ...)."""
    _check_tensors(tensors)
    _tf.save_file(tensors, filename, metadata=metadata, **options)


def save_file_async(tensors, filename, metadata=None, **options):
    """As save_file, but returns a tensorferry.SaveFuture (wait(), done(), result()) once every
    tensor is snapshotted into host memory (CUDA tensors of the current device are copied on
    torch's current stream); the file is finished in the background. `options`: those of
    tensorferry.save_file_async (staging, encoding, ...)."""
    _check_tensors(tensors)
    return _tf.save_file_async(tensors, filename, metadata=metadata, **options)


def save(tensors, metadata=None, **options):
    """The checkpoint as bytes."""
    _check_tensors(tensors)
    return _tf._save_bytes(tensors, metadata, **options)


def load_file(filename, device="cpu", *, verify=False, threads=0):
    """Every tensor of `filename` as a torch tensor on `device`: "cpu", "cuda" (the current
    device), "cuda:N", an int N or a torch.device. On the CPU raw tensors view a private
    copy-on-write mapping of the file, as safetensors' do (see tensorferry.load_file).
    `verify`: check every block's checksum first (DataLossError naming the tensor and block).
    `threads`: the library's host workers (0: its default)."""
    return _tf.load_file(filename, device=device, framework="pt", verify=verify, threads=threads)


def load(data):
    """Every tensor of a checkpoint given as bytes, as CPU torch tensors."""
    return _tf._load_bytes(data, lambda path: load_file(path, device="cpu"))


def _is_complete(t):
    storage = t.untyped_storage()
    return t.data_ptr() == storage.data_ptr() and \
        t.numel() * t.element_size() == storage.nbytes()


def _duplicate_names(state_dict, preferred=()):
    """{kept name: [names dropped]} for tensors sharing memory, keeping for each group a name
    that covers the whole storage (preferring `preferred`), as safetensors does."""
    preferred = set(preferred)
    out = {}
    for group in _tf.shared_tensor_groups(state_dict):
        complete = sorted(n for n in group if _is_complete(state_dict[n]))
        if not complete:
            raise RuntimeError(
                "tensorferry: tensors %s share memory and none covers the whole storage; "
                "refusing to save more bytes than the model holds" % sorted(group))
        keep = complete[0]
        favoured = [n for n in complete if n in preferred]
        if favoured:
            keep = favoured[0]
        out[keep] = sorted(n for n in group if n != keep)
    return out


def save_model(model, filename, metadata=None, force_contiguous=True, **options):
    """Saves `model.state_dict()`, storing tensors that share memory once: the other names are
    dropped and recorded in the metadata as dropped name -> kept name (like safetensors)."""
    state_dict = model.state_dict()
    for kept, dropped in _duplicate_names(state_dict).items():
        for name in dropped:
            metadata = {} if metadata is None else metadata
            metadata.setdefault(name, kept)
            del state_dict[name]
    if force_contiguous:
        state_dict = {k: v.contiguous() for k, v in state_dict.items()}
    save_file(state_dict, filename, metadata=metadata, **options)


def _direct_target(tensor, info):
    """True when the stored tensor's bytes can land in `tensor` as they are."""
    if info.dtype in ("F4_E2M1FN", "F6_E2M3FN", "F6_E3M2FN"):
        return False
    return (tensor.dtype == _dtypes.to_torch(info.dtype) and tuple(tensor.shape) == info.shape
            and tensor.is_contiguous() and tensor.layout == _torch.strided
            and tensor.device.type in ("cpu", "cuda"))


def load_model(model, filename, strict=True, device=None, *, verify=False):
    """Loads `filename` into `model`'s own tensors and returns (missing, unexpected): names
    of the model the file lacks, and names in the file the model does not use.

    Each tensor is read straight into the module's tensor, on that tensor's device and that
    device's current stream (so a model on cuda:1 is loaded on cuda:1 and no other GPU is
    touched); tensors whose dtype, shape or layout differ go through
    ``model.load_state_dict`` and get its conversions and size checks. With `strict`, missing
    or unexpected names raise RuntimeError (the message safetensors gives) after the load.
    `device` is accepted for safetensors compatibility and not used. `verify`: check every
    block's checksum before anything is loaded into the model (DataLossError naming the tensor
    and block; the model is then untouched).
    """
    state = model.state_dict()
    with _tf.Reader(filename) as reader:
        if verify:
            reader.verify()
        file_names = reader.keys()
        dropped = _duplicate_names(state, preferred=file_names)
        direct = {}
        other = {}
        for name in file_names:
            target = state.get(name)
            if target is None:
                continue
            if _direct_target(target, reader.info(name)):
                direct.setdefault(target.device, []).append((name, target))
            else:
                other[name] = _tf._torch_host(reader, name)
        with _torch.no_grad():
            for dev, items in direct.items():
                if dev.type == "cpu":
                    for name, t in items:
                        if t.numel():
                            reader.read_into(name, t.data_ptr(), reader.region(name)[1])
                    continue
                index = dev.index if dev.index is not None else _torch.cuda.current_device()
                targets = [(name, None, t, reader.region(name)[1]) for name, t in items
                           if t.numel()]
                if targets:
                    with _torch.cuda.device(index):
                        stream = _torch.cuda.current_stream(index)
                        _tf._default_loader(index).load_into(reader, targets,
                                                             stream=stream.cuda_stream)
    if other:
        model.load_state_dict(other, strict=False)
    loaded = set(file_names)
    missing = set(n for n in state if n not in loaded)
    unexpected = [n for n in file_names if n not in state]
    for names in dropped.values():
        for name in names:
            if name in missing:
                missing.remove(name)
            else:
                unexpected.append(name)
    if strict and (missing or unexpected):
        error = "Error(s) in loading state_dict for %s:" % model.__class__.__name__
        if missing:
            error += "\n    Missing key(s) in state_dict: " + ", ".join(
                '"%s"' % k for k in sorted(missing))
        if unexpected:
            error += "\n    Unexpected key(s) in state_dict: " + ", ".join(
                '"%s"' % k for k in sorted(unexpected))
        raise RuntimeError(error)
    return missing, unexpected
