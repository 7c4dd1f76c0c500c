"""Nested state flattened the way `ferry convert` imports a torch.save file
(tensorferry._state, used by tensorferry.torch.save_state_dict), and plain values read back
typed. Needs no torch: numpy arrays stand in for tensors, and tests/python/torch_like.py
writes the torch.save files."""

import numpy as np
import pytest

import tensorferry as tf
import torch_like as tl
from tensorferry import _state


def nested(make):
    """A training checkpoint's shape, tensors made by `make` from numpy arrays."""
    return {
        "model": {"embed.weight": make(np.arange(12, dtype=np.float32).reshape(3, 4)),
                  "norm.bias": make(np.zeros(4, dtype=np.float32))},
        "optimizer": {
            "state": {0: {"step": 3, "exp_avg": make(np.ones(4, dtype=np.float32))},
                      1: {"step": 3, "exp_avg": make(np.full(2, 2, dtype=np.float32))}},
            "param_groups": [{"lr": 0.25, "betas": (0.5, 0.75), "amsgrad": False,
                              "params": [0, 1], "foreach": None}],
        },
        "step": 10,
        "run": "run-1",
        "schedule": [{"warmup": 100}, {"decay": 0.5}],
    }


def test_names_and_values_match_ferry_convert(tmp_path):
    tl.torch_save(nested(tl.tensor), tmp_path / "ckpt.pt")
    tf.convert(str(tmp_path / "ckpt.pt"), str(tmp_path / "imported.ferry"))
    tensors, values, dropped = _state.flatten(nested(lambda a: a),
                                              lambda v: isinstance(v, np.ndarray))
    assert dropped == []
    assert sorted(tensors) == sorted(tf.load_file(str(tmp_path / "imported.ferry")))
    assert sorted(tensors) == ["model.embed.weight", "model.norm.bias",
                               "optimizer.state.0.exp_avg", "optimizer.state.1.exp_avg"]
    imported = tf.read_metadata(str(tmp_path / "imported.ferry"), typed=True)
    assert {k: _state.decode_value(v) for k, v in values.items()} == imported
    assert imported == {
        "optimizer.state.0.step": 3, "optimizer.state.1.step": 3,
        "optimizer.param_groups.0.lr": 0.25, "optimizer.param_groups.0.betas": [0.5, 0.75],
        "optimizer.param_groups.0.amsgrad": False, "optimizer.param_groups.0.params": [0, 1],
        "optimizer.param_groups.0.foreach": None, "step": 10, "run": "run-1",
        "schedule.0.warmup": 100, "schedule.1.decay": 0.5}


def test_imported_values_come_back_typed(tmp_path):
    obj = {"w": tl.tensor(np.arange(3, dtype=np.int64)), "epoch": 7, "lr": 0.001,
           "amp": True, "name": "run-1", "betas": (0.9, 0.999), "none": None, "big": 2 ** 40,
           "neg": -1e-05, "empty": []}
    tl.torch_save(obj, tmp_path / "m.pt")
    tf.convert(str(tmp_path / "m.pt"), str(tmp_path / "m.ferry"))
    typed = tf.read_metadata(str(tmp_path / "m.ferry"), typed=True)
    assert typed == {"epoch": 7, "lr": 0.001, "amp": True, "name": "run-1",
                     "betas": [0.9, 0.999], "none": None, "big": 2 ** 40, "neg": -1e-05,
                     "empty": []}
    assert type(typed["epoch"]) is int and type(typed["lr"]) is float
    # Without typed=, metadata stays str -> str, as in safetensors.
    assert tf.read_metadata(str(tmp_path / "m.ferry"))["epoch"] == "7"


def test_floats_keep_their_type_and_texts_stay_texts():
    for value in (1.0, 0.1, -2.5e-300, float("inf"), 1e22):
        assert _state.decode_value(_state._scalar_text(value)) == value
        assert type(_state.decode_value(_state._scalar_text(value))) is float
    for text in ("run-1", "1.2.3", "[a, b]", "0x10", "", "true", "[1, b]"):
        assert _state.decode_value(text) == text


def test_what_is_not_stored_is_refused_or_left_out_by_name():
    is_array = lambda v: isinstance(v, np.ndarray)  # noqa: E731
    with pytest.raises(TypeError, match=r"entry 'opt.fn' is object: only tensors and plain"):
        _state.flatten({"opt": {"fn": object()}}, is_array)
    with pytest.raises(TypeError, match=r"entry 'opt' has a key of type tuple, \(1, 2\)"):
        _state.flatten({"opt": {(1, 2): 3}}, is_array)
    with pytest.raises(ValueError, match="both named 'a.b'"):
        _state.flatten({"a": {"b": 1}, "a.b": 2}, is_array)
    tensors, values, dropped = _state.flatten(
        {"w": np.zeros(1), "fn": len, "x._extra_state": np.zeros(1)}, is_array,
        set_aside=lambda name, value: name.endswith("._extra_state"), skip_others=True)
    assert list(tensors) == ["w"] and values == {} and sorted(dropped) == ["fn",
                                                                            "x._extra_state"]
