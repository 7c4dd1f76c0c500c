"""torch integration: a module's state_dict and its FP8 scaling state, with no pickle.

    import tensorferry.torch as tft
    tft.save_state_dict(model, "ckpt.ferry", scaling_state=fp8_state, metadata={"step": "100"})
    state = tft.load_state_dict("ckpt.ferry", module=model)       # current device, stream
    fp8_state = tft.load_scaling_state("ckpt.ferry")               # tensors on current device

Loading targets torch.cuda.current_device() and torch.cuda.current_stream() (or the device
you name); nothing is created on any other GPU. The scaling state is structured data
(tensorferry._scaling): recipe fields, ``scale`` F32[S] and ``amax_history`` F32[L, S] per
direction, stored in the checkpoint's ScalingState tables.
"""

import torch as _torch

import tensorferry as _tf
from tensorferry import _scaling

__all__ = ["save_state_dict", "load_state_dict", "load_scaling_state", "recipe_to_dict",
           "load_te_extra_state"]

recipe_to_dict = _scaling.recipe_to_dict


def _default_device(device):
    if device is not None:
        return device
    return "cuda" if _torch.cuda.is_available() else "cpu"


def save_state_dict(state_dict, path, *, metadata=None, scaling_state=None,
                    extra_state="error", encoding="raw", zstd_level=None, durable=True):
    """Saves a state_dict (or a module's) with its FP8 scaling state.

    Entries that are not tensors, and TransformerEngine's pickled ``_extra_state`` tensors,
    are refused (extra_state="error") or dropped (extra_state="skip"): pass FP8 state as
    `scaling_state` instead, so that nothing executable or device-bound lands in the file.
    """
    if isinstance(state_dict, _torch.nn.Module):
        state_dict = state_dict.state_dict()
    if extra_state not in ("error", "skip"):
        raise ValueError("tensorferry: extra_state must be 'error' or 'skip'")
    tensors = {}
    for name, value in state_dict.items():
        is_extra = name.endswith("_extra_state")
        if is_extra or not isinstance(value, _torch.Tensor):
            if extra_state == "skip":
                continue
            raise TypeError(
                "tensorferry: state_dict entry %r is %s; only tensors are stored (FP8 state "
                "goes in scaling_state=..., never pickled). Pass extra_state='skip' to drop "
                "such entries." % (name, "pickled extra state" if is_extra else
                                   type(value).__name__))
        tensors[name] = value
    _tf.save_file(tensors, path, metadata=metadata, encoding=encoding, zstd_level=zstd_level,
                  durable=durable, scaling_state=scaling_state)


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
