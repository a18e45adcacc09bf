"""``%dist_diff`` on a rank, for what is not a tensor: which objects hold fields (compared
field by field), and a few bytes that say a plain value (a digest, equal on two processes
exactly when the values are equal, whatever their hash seeds), or that it has no value
equality. Generators by their state (``torch.Generator.get_state()``, a numpy generator's
``bit_generator.state``, ``random.Random.getstate()``), sets by content, dicts by key,
numpy arrays by dtype, shape and bytes; where two arrays differ (``array_difference``).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import random
import re
import sys
import types
from collections.abc import Mapping
from typing import Any

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_DEPTH = 64  # deeper than this a value is not compared (a guard against cycles in fields)
_SHOWN = 120  # characters of a value shown in the table

# objects with a __dict__ that is not their value: code, namespaces and classes
_NOT_FIELDS = (
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.ModuleType,
    type,
    enum.Enum,
    random.SystemRandom,  # no state to compare: the system's entropy
)


class NoValueEquality(Exception):
    """A value holds an object of this type, which equals only itself."""

    def __init__(self, typename: str):
        super().__init__(typename)
        self.typename = typename


@dataclasses.dataclass(frozen=True)
class TypeOf:
    """The leaf an object with fields leaves besides its fields: its type, so that another
    type holding the same field names is not called identical."""

    obj: Any


@dataclasses.dataclass(frozen=True)
class Reference:
    """A field that refers back to an object it is inside of (a cycle): the path of that
    object, compared as a value."""

    path: str


def type_name(t: type) -> str:
    """'Config', 'torch.Generator', '_thread.lock': the module left out for builtins and
    classes defined in the notebook or inside a function."""
    module = getattr(t, "__module__", "") or ""
    name = getattr(t, "__qualname__", t.__name__)
    local = "<locals>." in name
    name = name.rsplit("<locals>.", 1)[-1]
    return name if local or module in ("builtins", "__main__") else f"{module}.{name}"


def own_equality(t: type) -> bool:
    """Whether ``t`` says when two of its objects are equal (else equal means the same)."""
    return getattr(t, "__eq__", object.__eq__) is not object.__eq__


def fields(obj: Any) -> list[tuple[str, Any]] | None:
    """A namedtuple's, dataclass's (those its ``==`` compares) or other object's fields (its
    ``__dict__``, and its ``__slots__`` where its type has no ``==`` of its own: a slot of a
    type with one can be a cache), in order; None for an object of another kind."""
    t = type(obj)
    if isinstance(obj, tuple) and hasattr(t, "_fields"):
        return list(zip(t._fields, obj))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.compare]
    if isinstance(obj, (Mapping, list, tuple, set, frozenset, *_NOT_FIELDS)):
        return None
    out = dict(vars(obj)) if isinstance(getattr(obj, "__dict__", None), dict) else {}
    if not own_equality(t):
        for klass in t.__mro__:
            slots = klass.__dict__.get("__slots__", ())
            for name in [slots] if isinstance(slots, str) else slots:
                if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                    out.setdefault(name, getattr(obj, name))
    if not out and not hasattr(obj, "__dict__"):
        return None
    return list(out.items())


def generator_state(obj: Any) -> tuple[str, str, Any] | None:
    """(what it is, how it is compared, its state) for a random generator; None otherwise."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Generator):
        device = "" if obj.device.type == "cpu" else f" on {obj.device}"
        text = f"torch.Generator{device} seed {obj.initial_seed()}"
        return text, "torch.Generator, compared by get_state()", obj.get_state()
    np = sys.modules.get("numpy")
    if np is not None:
        if isinstance(obj, np.random.Generator):
            obj = obj.bit_generator
        if isinstance(obj, np.random.BitGenerator):
            name = type(obj).__name__
            entropy = getattr(getattr(obj, "seed_seq", None), "entropy", None)
            seed = f" seed {entropy}" if isinstance(entropy, int) and entropy < 1 << 64 else ""
            how = f"numpy {name}, compared by bit_generator.state"
            return f"numpy {name}{seed}", how, obj.state
        if isinstance(obj, np.random.RandomState):
            return (
                "numpy RandomState",
                "numpy RandomState, compared by get_state()",
                obj.get_state(),
            )
    if isinstance(obj, random.Random) and not isinstance(obj, random.SystemRandom):
        return "random.Random", "random.Random, compared by getstate()", obj.getstate()
    return None


def canonical(value: Any, depth: int = 0) -> str:
    """A text that is the same on two processes exactly when the values are equal: sets
    and dicts in a sorted order (their own order depends on the hash seed), arrays and
    tensors by their bytes, objects with fields field by field, classes by name, other
    values by their repr. Raises NoValueEquality for a value holding an object that equals
    only itself and has no fields and no repr but its address (``object()``, a lock, a
    function): there is nothing to compare on another process."""
    if depth > _DEPTH:
        raise NoValueEquality(f"a value nested deeper than {_DEPTH}")
    t = type(value)
    if value is None or t in (bool, int, float, complex, str, bytes):
        return repr(value)

    def inner(v: Any) -> str:
        return canonical(v, depth + 1)

    name = type_name(t)
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    if torch is not None and isinstance(value, torch.Tensor):
        from .tensor_hash import checksum
        from .tensor_leaves import local

        data = local(value)
        return f"{name}({data.dtype}, {list(value.shape)}, {checksum(data.cpu())})"
    if np is not None and isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            return f"ndarray(object, {value.shape}, {inner(value.tolist())})"
        data = hashlib.blake2b(array_bytes(value), digest_size=16).hexdigest()
        return f"ndarray({value.dtype.str}, {value.shape}, {data})"
    state = generator_state(value)
    if state is not None:
        return f"{name}({inner(state[2])})"
    if isinstance(value, Mapping):
        return name + _braces(f"{inner(k)}: {inner(v)}" for k, v in value.items())
    if isinstance(value, (set, frozenset)):
        return name + _braces(inner(v) for v in value)
    found = fields(value)
    if found:
        return name + "(" + ", ".join(f"{k}={inner(v)}" for k, v in found) + ")"
    if isinstance(value, (list, tuple)):
        return name + "(" + ", ".join(inner(v) for v in value) + ")"
    if isinstance(value, type):  # a class equals only itself: the same class by its name
        return f"class {value.__module__}.{value.__qualname__}"
    if isinstance(value, enum.Enum) or own_equality(t):
        return _ADDRESS.sub(" at 0x...", repr(value))
    text = repr(value)
    if not _ADDRESS.search(text):  # a repr that says what it is (torch.float32), not where
        return text
    raise NoValueEquality(name)


def _braces(items) -> str:
    """Items in a sorted order, in braces: the order a set or dict was filled in, or its
    hash seed, does not show."""
    return "{" + ", ".join(sorted(items)) + "}"


def show(value: Any) -> str:
    """A value as the table shows it: its repr (a set's elements sorted, an address left
    out), cut at 120 characters."""
    if isinstance(value, (set, frozenset)):
        inside = _braces(_ADDRESS.sub(" at 0x...", repr(v)) for v in value)
        plain = type(value) is set and value
        text = inside if plain else f"{type(value).__name__}({inside})"
    else:
        text = _ADDRESS.sub(" at 0x...", repr(value))
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def describe(value: Any) -> dict:
    """What the kernel compares of a leaf that is not a tensor: ``kind`` "value" (``sum``
    the digest, ``value`` the text shown, ``differs`` what a difference is called),
    "ndarray" (dtype, shape and a digest of its bytes), "type" (of an object whose fields
    are leaves of their own) or "opaque" (no value equality: ``sum`` its type)."""
    if isinstance(value, TypeOf):
        return {"kind": "type", "value": type_name(type(value.obj)), "sum": _full_name(value.obj)}
    if isinstance(value, Reference):
        text = f"<the object at {value.path or 'the top'}>"
        return {"kind": "value", "value": text, "sum": digest(text)}
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.ndarray):
        return describe_array(value)
    state = generator_state(value)
    try:
        text = canonical(value)
    except NoValueEquality as e:
        return {"kind": "opaque", "value": e.typename, "sum": e.typename}
    out = {"kind": "value", "sum": digest(text)}
    if state is not None:
        shown, how, _ = state
        out.update(value=f"{shown} state {out['sum'][:8]}", differs=f"state differs ({how})")
    elif isinstance(value, (set, frozenset)):
        out.update(value=show(value), differs="value differs (compared by content)")
    else:
        out.update(value=show(value))
    return out


def _full_name(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def describe_array(a) -> dict:
    """A numpy array: its dtype, shape and a digest of its bytes (of its elements, compared
    as values, for an object array, which has no bytes to send: ``sendable`` False)."""
    out = {"kind": "ndarray", "shape": list(a.shape), "dtype": a.dtype.str, "device": "cpu"}
    try:
        out["sum"] = digest(canonical(a))
    except NoValueEquality as e:
        return {"kind": "opaque", "value": e.typename, "sum": e.typename}
    if a.dtype.hasobject:
        out.update(sendable=False, differs="values differ (an object array: not measured)")
    return out


def array_bytes(a):
    """An array's elements as flat bytes (C order)."""
    import numpy as np

    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def array_difference(mine, theirs) -> dict:
    """Where two arrays of one dtype and shape differ, element by element (by their bytes,
    as the digest compares them): how many elements, of how many, the first index and the
    largest absolute difference (None where the dtype has no arithmetic: strings, dates)."""
    import numpy as np

    n = mine.size
    width = mine.dtype.itemsize
    a = array_bytes(mine).reshape(n, width)
    b = array_bytes(theirs).reshape(n, width)
    differ = (a != b).any(axis=1) if width else np.zeros(n, dtype=bool)
    count = int(differ.sum())
    first = np.unravel_index(int(differ.argmax()), mine.shape) if count else ()
    return {
        "count": count,
        "of": n,
        "first": [int(i) for i in first],
        "max": _largest(mine, theirs),
    }


def _largest(a, b) -> float | int | None:
    """max |a - b| through torch (exact for 64-bit integers): see largest_difference."""
    import warnings

    import torch

    from .tensor_leaves import largest_difference

    if a.dtype.kind not in "biufc":
        return None
    with warnings.catch_warnings():  # a read-only array: torch only warns, nothing is written
        warnings.simplefilter("ignore")
        try:
            return largest_difference(torch.from_numpy(a), torch.from_numpy(b))
        except TypeError:  # a dtype torch lacks (float128)
            return None
