"""The Multi-GPU pool's control messages: plain data as one line of JSON each.

Nothing a worker or rank 0 receives is unpickled. Python values outside JSON are tagged:
tuples, sets, dicts (any keys), torch dtypes, enums, and classes, which are named by module
and qualified name and looked up (never called) on decoding: a class must be a torch module
(the model and its ops classes), an enum's class an Enum. Whatever else a value holds is
refused on encoding (`TypeError`), and a line that does not decode raises `ValueError`.
"""

import enum
import importlib
import json

import torch


class Slot:
    """Where a tensor (by index) or the transformer options (index -1) go in a call's args."""

    def __init__(self, i: int):
        self.i = i

    def __eq__(self, other):
        return isinstance(other, Slot) and other.i == self.i

    def __repr__(self):
        return f"Slot({self.i})"


def _name(cls: type) -> str:
    name = f"{cls.__module__}:{cls.__qualname__}"
    try:
        found = _lookup(name, object)
    except (ImportError, AttributeError, ValueError):
        found = None
    if found is not cls:
        raise TypeError(f"class {cls.__qualname__} cannot be looked up as {name}")
    return name


def _lookup(name: str, base: type) -> type:
    module, _, qualname = name.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise ValueError(f"{name} is not a {base.__name__} class")
    return obj


def encode(obj):
    """`obj` as JSON-able data (see the module's docstring)."""
    if obj is None or type(obj) in (bool, int, float, str):
        return obj
    if isinstance(obj, enum.Enum):
        return {"enum": _name(type(obj)), "value": encode(obj.value)}
    if type(obj) is list:
        return [encode(o) for o in obj]
    if type(obj) in (tuple, set, frozenset):
        return {type(obj).__name__: [encode(o) for o in obj]}
    if type(obj) is dict:
        return {"dict": [[encode(k), encode(v)] for k, v in obj.items()]}
    if isinstance(obj, Slot):
        return {"slot": obj.i}
    if isinstance(obj, torch.dtype):
        return {"dtype": str(obj).removeprefix("torch.")}
    if isinstance(obj, type) and issubclass(obj, torch.nn.Module):
        return {"class": _name(obj)}
    raise TypeError(f"{type(obj).__qualname__} is not plain data")


def decode(data):
    """The value `encode` gave `data` for."""
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is list:
        return [decode(o) for o in data]
    if type(data) is dict and data.keys() == {"enum", "value"}:
        return _lookup(data["enum"], enum.Enum)(decode(data["value"]))
    if type(data) is not dict or len(data) != 1:
        raise ValueError(f"not a tagged value: {str(data)[:80]}")
    [(tag, value)] = data.items()
    if tag == "tuple":
        return tuple(decode(o) for o in value)
    if tag in ("set", "frozenset"):
        return {"set": set, "frozenset": frozenset}[tag](decode(o) for o in value)
    if tag == "dict":
        return {decode(k): decode(v) for k, v in value}
    if tag == "slot" and type(value) is int:
        return Slot(value)
    if tag == "dtype" and isinstance(getattr(torch, str(value), None), torch.dtype):
        return getattr(torch, value)
    if tag == "class":
        return _lookup(value, torch.nn.Module)
    raise ValueError(f"unknown tag {tag!r}")


def dumps(message: dict) -> bytes:
    """One message as a line (`json.dumps` escapes newlines in strings)."""
    return json.dumps(encode(message), allow_nan=True).encode() + b"\n"


def loads(line: bytes) -> dict:
    """A line of `dumps` as the message; ValueError for anything else."""
    try:
        message = decode(json.loads(line))
    except (ValueError, TypeError, LookupError, ImportError, AttributeError) as e:
        raise ValueError(f"{type(e).__name__}: {e}") from None
    if not isinstance(message, dict):
        raise ValueError("not a message")
    return message
