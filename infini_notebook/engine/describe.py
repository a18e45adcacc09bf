"""The rank's side of the MCP server's ``pull`` (infini_notebook/mcp): a value described where
it lives, its repr cut at a cap, with shape, dtype, device and size, so an agent sees a
large tensor without its bytes crossing to the kernel (``%dist_pull`` brings the value
itself, kernel/transfer.py). torch is imported only if the rank has it loaded."""

from __future__ import annotations

import sys
from typing import Any

from .bootstrap import user_namespace


def describe(expression: str, max_chars: int) -> dict:
    """``expression`` (a name, or any expression) evaluated in the rank's namespace."""
    ns = user_namespace()
    if expression.isidentifier():
        if expression not in ns:
            raise NameError(f"name {expression!r} is not defined on this rank")
        value = ns[expression]
    else:
        value = eval(expression, ns)  # the agent's code, as a cell would run it
    text, cut = bounded_repr(value, max_chars)
    out: dict[str, Any] = {
        "type": f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins."),
        "repr": text[:max_chars],
        "truncated": cut or len(text) > max_chars,
    }
    out.update(_array_fields(value))
    return out


_BUILTINS = (str, bytes, bytearray, list, tuple, dict, set, frozenset)


def bounded_repr(value: Any, max_chars: int) -> tuple[str, bool]:
    """A repr that costs about ``max_chars``, not the value's size (a list of 10^8 numbers
    took a minute and gigabytes to repr in full), and whether it left something out.
    Tensors and arrays summarise themselves; builtin containers and strings go through
    ``reprlib`` with limits; other objects keep their own repr."""
    import reprlib

    if not isinstance(value, _BUILTINS):
        return repr(value), False
    items = max(4, max_chars // 8)
    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother = 6, max_chars, max_chars
    r.maxlist = r.maxtuple = r.maxset = r.maxfrozenset = r.maxdict = r.maxdeque = items
    limit = max_chars if isinstance(value, (str, bytes, bytearray)) else items
    return r.repr(value), len(value) > limit


def _array_fields(value: Any) -> dict:
    """shape, dtype, device and bytes of a tensor or an array; nothing for other values."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return {
            "shape": list(value.shape),
            "dtype": str(value.dtype),
            "device": str(value.device),
            "nbytes": value.numel() * value.element_size(),
        }
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if isinstance(shape, tuple) and all(isinstance(n, int) for n in shape) and dtype is not None:
        nbytes = getattr(value, "nbytes", None)
        return {
            "shape": list(shape),
            "dtype": str(dtype),
            "nbytes": nbytes if isinstance(nbytes, int) else None,
        }
    return {}
