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
    text = repr(value)
    out: dict[str, Any] = {
        "type": f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins."),
        "repr": text[:max_chars],
        "truncated": len(text) > max_chars,
    }
    out.update(_array_fields(value))
    return out


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
