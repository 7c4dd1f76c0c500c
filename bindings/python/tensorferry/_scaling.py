"""FP8 / FP4 scaling state as plain data: recipe fields, scale and amax history.

The structured form (what save_file(scaling_state=...) takes and read_scaling_state returns):

    {
        "layers.0.fc1": {
            "recipe": {"type": "DelayedScaling", "margin": 0, "fp8_format": "HYBRID",
                       "amax_history_len": 1024, "amax_compute_algo": "max",
                       "reduce_amax": True, "fp8_dpa": False, "fp8_mha": False},
            "states": [
                {"direction": "forward", "num_gemms": 1,
                 "slot_roles": ["input", "weight", "output"],
                 "scale": float32[S], "amax_history": float32[L, S]},   # row 0 current
                {"direction": "backward", ...},
            ],
        },
    }

Recipe types follow TransformerEngine's classes: DelayedScaling, Float8CurrentScaling,
MXFP8BlockScaling, Float8BlockScaling, NVFP4BlockScaling, and CustomRecipe (``name`` and
``qfactory`` strings only: callables are never serialized). ``"recipe": None`` records none.
Stateless recipes have ``"states": []``. A TransformerEngine recipe object may be passed in
place of the recipe dict (see recipe_to_dict).
"""

import ctypes

from . import _lib

RECIPE_KINDS = {
    None: 0,
    "DelayedScaling": 1,
    "Float8CurrentScaling": 2,
    "MXFP8BlockScaling": 3,
    "Float8BlockScaling": 4,
    "NVFP4BlockScaling": 5,
    "CustomRecipe": 6,
}
_KIND_NAMES = {v: k for k, v in RECIPE_KINDS.items()}
FP8_FORMATS = {"E4M3": 0, "E5M2": 1, "HYBRID": 2}
_FP8_NAMES = {v: k for k, v in FP8_FORMATS.items()}
AMAX_ALGOS = {"max": 0, "most_recent": 1}
_AMAX_NAMES = {v: k for k, v in AMAX_ALGOS.items()}
DIRECTIONS = {"forward": 0, "backward": 1}
_DIRECTION_NAMES = {v: k for k, v in DIRECTIONS.items()}
SLOT_ROLES = {"input": 0, "weight": 1, "output": 2, "grad_output": 3, "grad_input": 4}
_SLOT_NAMES = {v: k for k, v in SLOT_ROLES.items()}

# Fields of each recipe type, as (name, kind): kind "fmt", "algo", "bool" or "int".
_FIELDS = {
    "DelayedScaling": [("fp8_format", "fmt"), ("margin", "int"), ("amax_history_len", "int"),
                       ("amax_compute_algo", "algo"), ("reduce_amax", "bool"),
                       ("fp8_dpa", "bool"), ("fp8_mha", "bool")],
    "Float8CurrentScaling": [("fp8_format", "fmt"), ("fp8_dpa", "bool"), ("fp8_mha", "bool")],
    "MXFP8BlockScaling": [("fp8_format", "fmt")],
    "Float8BlockScaling": [("fp8_format", "fmt"), ("x_block_scaling_dim", "int"),
                           ("w_block_scaling_dim", "int"), ("grad_block_scaling_dim", "int")],
    "NVFP4BlockScaling": [("disable_rht", "bool"), ("disable_stochastic_rounding", "bool"),
                          ("disable_2d_quantization", "bool")],
    "CustomRecipe": [],
}


def _enum_name(value):
    # TransformerEngine keeps formats as enums (Format.HYBRID); accept them by name.
    return getattr(value, "name", value)


def recipe_to_dict(recipe):
    """A recipe dict from a recipe dict or from a TransformerEngine recipe object (read by
    attribute name; callables such as a custom amax_compute_algo are refused)."""
    if recipe is None or isinstance(recipe, dict):
        return recipe
    kind = type(recipe).__name__
    if kind not in _FIELDS:
        raise TypeError("tensorferry: unknown recipe type %s" % kind)
    out = {"type": kind}
    for field, _ in _FIELDS[kind]:
        if hasattr(recipe, field):
            value = getattr(recipe, field)
            if callable(value) and not isinstance(value, (bool, int, str)):
                raise TypeError(
                    "tensorferry: recipe field %s is a callable; callables are never "
                    "serialized" % field)
            out[field] = _enum_name(value)
    return out


def _c_recipe(recipe, module):
    recipe = recipe_to_dict(recipe)
    c = _lib.Recipe()
    kind = None if recipe is None else recipe.get("type")
    if kind not in RECIPE_KINDS:
        raise ValueError("tensorferry: scaling state %r: unknown recipe type %r" % (module, kind))
    _lib.lib().ferry_recipe_init(ctypes.byref(c), RECIPE_KINDS[kind])
    keep = []
    if kind is None:
        return c, keep
    allowed = {f for f, _ in _FIELDS[kind]} | {"type"}
    if kind == "CustomRecipe":  # the library refuses one without a name
        allowed |= {"name", "qfactory"}
        keep.append(_lib.text(recipe.get("name") or "", "CustomRecipe name"))
        c.custom_name = keep[-1]
        if recipe.get("qfactory"):
            keep.append(_lib.text(str(recipe["qfactory"]), "CustomRecipe qfactory"))
            c.custom_qfactory = keep[-1]
    unknown = set(recipe) - allowed
    if unknown:
        raise ValueError("tensorferry: scaling state %r: unknown %s fields %s"
                         % (module, kind, sorted(unknown)))
    for field, ftype in _FIELDS[kind]:
        if field not in recipe:
            continue
        value = _enum_name(recipe[field])
        if ftype == "fmt":
            if value not in FP8_FORMATS:
                raise ValueError("tensorferry: scaling state %r: fp8_format %r not in %s"
                                 % (module, value, sorted(FP8_FORMATS)))
            value = FP8_FORMATS[value]
        elif ftype == "algo":
            if value not in AMAX_ALGOS:
                raise ValueError("tensorferry: scaling state %r: amax_compute_algo %r not in %s"
                                 % (module, value, sorted(AMAX_ALGOS)))
            value = AMAX_ALGOS[value]
        else:
            value = int(value)
        setattr(c, field, value)
    return c, keep


def add_to_writer(writer, scaling_state):
    """Adds every module of a structured scaling-state dict to a C writer handle."""
    import numpy as np

    for module, entry in scaling_state.items():
        if not isinstance(entry, dict):
            raise TypeError("tensorferry: scaling state %r must be a dict" % module)
        recipe, keep = _c_recipe(entry.get("recipe"), module)
        states = entry.get("states") or []
        cstates = (_lib.DirectionState * max(1, len(states)))()
        for i, st in enumerate(states):
            roles = [SLOT_ROLES[_enum_name(r)] if not isinstance(r, int) else r
                     for r in st.get("slot_roles", [])]
            scale = np.ascontiguousarray(_to_numpy(st["scale"]), dtype=np.float32).reshape(-1)
            s = scale.size
            hist = np.ascontiguousarray(_to_numpy(st["amax_history"]), dtype=np.float32)
            if hist.size == 0:
                hist = np.zeros((0, s), np.float32)
            elif hist.ndim == 1 and s:
                hist = hist.reshape(-1, s)
            if hist.ndim != 2:
                raise ValueError("tensorferry: scaling state %r: amax_history must be [L, S]"
                                 % module)
            if len(roles) != s or hist.shape[1] != s:
                raise ValueError(
                    "tensorferry: scaling state %r direction %d: %d slot roles, %d scales, "
                    "amax_history %s disagree" % (module, i, len(roles), s, tuple(hist.shape)))
            direction = st.get("direction", "forward")
            if direction not in DIRECTIONS:
                raise ValueError("tensorferry: scaling state %r: direction %r not in %s"
                                 % (module, direction, sorted(DIRECTIONS)))
            roles_arr = np.asarray(roles, dtype=np.int32)
            keep += [roles_arr, scale, hist]
            cs = cstates[i]
            cs.direction = DIRECTIONS[direction]
            cs.num_gemms = int(st.get("num_gemms", 1))
            cs.num_slots = s
            cs.history_len = hist.shape[0] if hist.size else 0
            cs.slot_roles = roles_arr.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
            cs.scale = scale.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            cs.amax_history = hist.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        _lib.call("ferry_writer_add_scaling_state", writer, _lib.text(str(module), "module name"),
                  ctypes.byref(recipe), cstates, len(states))


def _to_numpy(value):
    import numpy as np

    if hasattr(value, "detach"):  # a torch tensor, on any device
        return value.detach().to("cpu").float().numpy()
    return np.asarray(value)


def read_all(reader_handle):
    """The structured scaling-state dict of an open C reader handle (numpy arrays)."""
    import numpy as np

    L = _lib.lib()
    out = {}
    for i in range(L.ferry_reader_num_scaling_states(reader_handle)):
        st = _lib.ScalingState()
        st.struct_size = ctypes.sizeof(st)
        _lib.call("ferry_reader_scaling_state_at", reader_handle, i, ctypes.byref(st))
        r = st.recipe
        kind = _KIND_NAMES.get(r.kind)
        recipe = None
        if kind is not None:
            recipe = {"type": kind}
            for field, ftype in _FIELDS[kind]:
                v = getattr(r, field)
                if ftype == "fmt":
                    v = _FP8_NAMES.get(v, v)
                elif ftype == "algo":
                    v = _AMAX_NAMES.get(v, v)
                elif ftype == "bool":
                    v = bool(v)
                recipe[field] = v
            if kind == "CustomRecipe":
                recipe["name"] = (_lib.decode(r.custom_name, None, "CustomRecipe name")
                                  if r.custom_name else "")
                recipe["qfactory"] = (_lib.decode(r.custom_qfactory, None, "CustomRecipe qfactory")
                                      if r.custom_qfactory else None)
        states = []
        for k in range(st.num_states):
            d = st.states[k]
            s, h = d.num_slots, d.history_len
            scale = np.array([d.scale[j] for j in range(s)], dtype=np.float32) if s else \
                np.zeros(0, np.float32)
            if s and h:
                buf = (ctypes.c_float * (s * h)).from_address(
                    ctypes.addressof(d.amax_history.contents))
                hist = np.frombuffer(buf, dtype=np.float32).reshape(h, s).copy()
            else:
                hist = np.zeros((h, s), np.float32)
            states.append({
                "direction": _DIRECTION_NAMES.get(d.direction, d.direction),
                "num_gemms": d.num_gemms,
                "slot_roles": [_SLOT_NAMES.get(d.slot_roles[j], d.slot_roles[j])
                               for j in range(s)],
                "scale": scale,
                "amax_history": hist,
            })
        out[_lib.decode(st.module, None, "scaling state module name")] = {"recipe": recipe, "states": states}
    return out
