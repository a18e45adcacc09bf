"""Routing and id mapping for JupyterLab's debugger over ranks (issue 52). Pure.

The kernel speaks the Debug Adapter Protocol to JupyterLab for its own threads (ipykernel's
debugger) and for every rank (one debugpy per rank). Threads, frames and variable
references are small counters in each debugpy (pydevd's ``_IdMap`` in
pydevd_process_net_command_json.py), so the same number names different things in the
kernel and in each rank. A rank's id ``i`` is shown to JupyterLab as
``(rank + 1) * STRIDE + i``; anything below STRIDE is the kernel's and goes to ipykernel
unchanged. 0 stays 0 (DAP: "no children").
"""

from __future__ import annotations

import ast

STRIDE = 1_000_000_000

# Request arguments that name a thread, a frame or a variable: the request goes where it lives
_ROUTE_KEYS = ("threadId", "frameId", "variablesReference", "srcFrameId")
# Keys whose ids a rank's replies and events carry, wherever they sit in the body
_ID_KEYS = frozenset({"threadId", "frameId", "variablesReference"})


def to_proxy(rank: int, local: int) -> int:
    """The id JupyterLab sees for a rank's ``local`` id."""
    return (rank + 1) * STRIDE + local if local else 0


def split(value: int) -> tuple[int | None, int]:
    """``(rank, local id)`` for an id JupyterLab sent; ``(None, value)`` for the kernel's."""
    if not isinstance(value, int) or value < STRIDE:
        return None, value
    return value // STRIDE - 1, value % STRIDE


def route(arguments: dict | None) -> int | None:
    """The rank a request is for (by the first id it names), or None: the kernel's."""
    for key in _ROUTE_KEYS:
        if key in (arguments or {}):
            return split(arguments[key])[0]
    return None


def to_rank(arguments: dict | None) -> dict:
    """A request's arguments with the ids a rank knows (the proxy's prefix taken off)."""
    out = dict(arguments or {})
    for key in _ROUTE_KEYS:
        if isinstance(out.get(key), int):
            out[key] = split(out[key])[1]
    return out


def from_rank(rank: int, body, paths: dict[str, str] | None = None):
    """A rank's reply or event body with its ids as JupyterLab sees them, and the source
    paths of cells (the rank's file for a ``%%dist`` cell) as the kernel's (the path
    JupyterLab's dumpCell gave for that cell, which it knows the cell by)."""
    paths = paths or {}
    if isinstance(body, list):
        return [from_rank(rank, item, paths) for item in body]
    if not isinstance(body, dict):
        return body
    out = {}
    for key, value in body.items():
        if key in _ID_KEYS and isinstance(value, int):
            out[key] = to_proxy(rank, value)
        elif key == "path" and isinstance(value, str):
            out[key] = paths.get(value, value)
        else:
            out[key] = from_rank(rank, value, paths)
    return out


def stack_frames(rank: int, frames: list[dict], paths: dict[str, str]) -> list[dict]:
    """A rank's stackTrace frames: ids mapped, cells named by the kernel's path, and each
    frame's name saying the rank (JupyterLab's Callstack shows names, not threads)."""
    out = []
    for frame in from_rank(rank, frames, paths):
        frame["id"] = to_proxy(rank, frame.get("id", 0))
        frame["name"] = f"rank {rank}: {frame.get('name', '')}"
        out.append(frame)
    return out


def thread_name(rank: int, name: str, main: str) -> str:
    """``rank 1`` for a rank's cell thread, ``rank 1 (worker)`` for another of its threads."""
    return f"rank {rank}" if name == main else f"rank {rank} ({name})"


def dist_body(transformed: str) -> str | None:
    """The code a ``%%dist`` cell sends to its ranks (the body IPython passes the magic),
    from the cell as IPython transformed it: ``get_ipython().run_cell_magic('dist', flags,
    body)``. None for any other cell."""
    try:
        tree = ast.parse(transformed)
    except SyntaxError:
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Expr):
        return None
    call = tree.body[0].value
    if not (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "run_cell_magic"
        and len(call.args) == 3
        and all(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in call.args)
        and call.args[0].value == "dist"
    ):
        return None
    return call.args[2].value
