"""Nested state (``{"model": state_dict, "optimizer": optimizer.state_dict(), "step": 10}``) as
the flat names and string metadata a checkpoint holds, the way ``ferry convert`` imports a
torch.save file, and the typed values back out of that metadata.

Flattening: a dict entry is named ``parent.key`` (str or int keys), a list or tuple entry
``parent.index``; tensors become tensors; plain values (None, bools, ints, floats, strings)
become metadata, ``str(value)`` (``repr`` for floats, so they read back as floats); a list or
tuple of plain values becomes one metadata entry, ``[a, b, c]``. Anything else (another
object, a key of another type, bytes) is refused, naming the entry, unless the caller drops
it. This module needs neither torch nor numpy: the caller says what a tensor is.
"""

import numbers
import re

_INT = re.compile(r"[-+]?[0-9]+\Z")
_FLOAT = re.compile(r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?\Z")


def _scalar_text(value):
    """The metadata text of a plain value, or None when `value` is not one."""
    if value is None or isinstance(value, bool):
        return str(value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        return repr(float(value))
    if isinstance(value, str):
        return value
    return None


def flatten(state, is_tensor, set_aside=None, skip_others=False):
    """(tensors, values, dropped) of a nested state: {name: tensor}, {name: metadata text} and
    the names left out. `set_aside(name, value)`, when given, is asked first about every named
    entry and leaves it out by returning True (TransformerEngine's ``_extra_state``, say).
    An entry that is neither a tensor nor a plain value (another object, a key that is not a
    str or int) raises TypeError naming it, or is left out with `skip_others`. Two entries
    that flatten to one name raise ValueError."""
    tensors, values, dropped = {}, {}, []

    def claim(name):
        if name in tensors or name in values:
            raise ValueError("tensorferry: two entries of the state are both named %r" % name)

    def other(name, what):
        if not skip_others:
            raise TypeError("tensorferry: state %s: only tensors and plain values (None, "
                            "bool, int, float, str; lists, tuples and dicts of them, keyed by "
                            "str or int) are stored" % what)
        dropped.append(name)

    def walk(value, name, depth):
        if depth > 256:
            raise ValueError("tensorferry: state entry %r nests deeper than 256 levels (or "
                             "refers to itself)" % name)
        if set_aside is not None and name and set_aside(name, value):
            dropped.append(name)
            return
        if is_tensor(value):
            name = name or "tensor"
            claim(name)
            tensors[name] = value
            return
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, bool) or not isinstance(key, (str, numbers.Integral)):
                    where = "%s[%r]" % (name, key) if name else "[%r]" % (key,)
                    other(where, "%s has a key of type %s, %r" % (
                        "entry %r" % name if name else "top level", type(key).__name__, key))
                    continue
                part = key if isinstance(key, str) else str(int(key))
                walk(item, name + "." + part if name else part, depth + 1)
            return
        if isinstance(value, (list, tuple)) and name:
            texts = [_scalar_text(x) for x in value]
            if all(t is not None for t in texts):
                claim(name)
                values[name] = "[" + ", ".join(texts) + "]"
                return
            for i, item in enumerate(value):
                walk(item, name + "." + str(i), depth + 1)
            return
        text = _scalar_text(value)
        if text is not None and name:
            claim(name)
            values[name] = text
            return
        other(name, "entry %r is %s" % (name, type(value).__name__) if name
              else "is %s, not a dict" % type(value).__name__)

    walk(state, "", 0)
    return tensors, values, dropped


def decode_value(text):
    """A metadata text as the plain value it was written from, by the rules of `flatten` (and
    of ``ferry convert``'s torch import): None, True/False, ints, floats (also "inf", "nan"),
    lists of those; any other text stays a str."""
    if text == "None":
        return None
    if text in ("True", "False"):
        return text == "True"
    if _INT.match(text):
        return int(text)
    if _FLOAT.match(text) or text.lower().lstrip("+-") in ("inf", "nan", "infinity"):
        return float(text)
    if text.startswith("[") and text.endswith("]"):
        inner = text[1:-1]
        if not inner:
            return []
        items = [decode_value(part) for part in inner.split(", ")]
        if not any(isinstance(x, str) for x in items):
            return items
    return text
