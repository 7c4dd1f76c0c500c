"""TransformerEngine extra state from a checkpoint's scaling-state tables.

A TransformerEngine module keeps its FP8 state in ``<module>._extra_state``; its
``set_extra_state`` accepts a uint8 tensor holding ``pickle.dumps(dict)`` with "scale_fwd"
F32[S], "amax_history_fwd" F32[L, S], "scale_bwd", "amax_history_bwd",
"extra_fp8_variables" and, in 2.x, "recipe" (a recipe object), or an empty uint8 tensor for a
module without FP8 state. This module builds that dict from the structured scaling state
(tensorferry._scaling) and the module's extra_fp8_variables, which the importer keeps as JSON
metadata under EXTRA_VARIABLES_PREFIX + module. The scale tensors it puts in the dict are CPU
tensors, so unpickling it never touches a GPU; the recipe object is built only when
transformer_engine is importable (the dict then matches what TransformerEngine itself
writes; without it "recipe" is left out, and set_extra_state keeps the module's own recipe).
"""

import json

import numpy as np

EXTRA_VARIABLES_PREFIX = "transformer_engine.extra_fp8_variables."


def extra_fp8_variables(metadata, module):
    """The module's extra_fp8_variables dict from a checkpoint's metadata, or {}."""
    text = (metadata or {}).get(EXTRA_VARIABLES_PREFIX + module)
    return json.loads(text) if text else {}


def extra_state_dict(entry, extra_variables, to_tensor):
    """The dict TransformerEngine pickles for one module, without "recipe"; None when the
    module has no FP8 state (no recipe and no scaling state). `to_tensor` turns a float32
    numpy array into the tensor type to store."""
    states = {s["direction"]: s for s in entry.get("states") or []}
    if not states and entry.get("recipe") is None:
        return None
    out = {}
    for direction, sfx in (("forward", "fwd"), ("backward", "bwd")):
        st = states.get(direction)
        if st is None:
            continue
        scale = np.ascontiguousarray(np.asarray(st["scale"], np.float32).reshape(-1))
        hist = np.asarray(st["amax_history"], np.float32).reshape(-1, scale.size)
        out["scale_" + sfx] = to_tensor(scale)
        out["amax_history_" + sfx] = to_tensor(np.ascontiguousarray(hist))
    out["extra_fp8_variables"] = dict(extra_variables or {})
    return out


def recipe_object(recipe):
    """A transformer_engine recipe object for a recipe dict, or None when there is no recipe
    or transformer_engine is not importable."""
    if not recipe or recipe.get("type") in (None, "CustomRecipe"):
        return None
    try:
        from transformer_engine.common import recipe as te_recipe
    except ImportError:
        return None
    cls = getattr(te_recipe, recipe["type"], None)
    if cls is None:
        return None
    kwargs = {}
    for k, v in recipe.items():
        if k == "type":
            continue
        if k == "fp8_format":
            v = te_recipe.Format[v]
        kwargs[k] = v
    return cls(**kwargs)
