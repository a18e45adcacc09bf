"""Cells with top-level ``await``: ipyparallel's engines (9.2) take such a cell and never
reply, so it would hang until interrupted. They are refused before they are sent, saying
what works instead. Pure: the cell's Python source in, the line of its first top-level await
(or ``async for``/``async with``) out."""

from __future__ import annotations

import ast

# What runs a coroutine on a rank: the engine's own event loop is busy running the cell, so
# asyncio.run() there raises; a fresh loop on a worker thread does not.
INSTEAD = "concurrent.futures.ThreadPoolExecutor(1).submit(asyncio.run, main()).result()"


def top_level_await(source: str) -> int | None:
    """The line of the first ``await``, ``async for`` or ``async with`` outside any function
    in ``source``; None when there is none (or the source does not parse as Python)."""
    try:
        tree = compile(
            source, "<cell>", "exec", flags=ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
        )
    except SyntaxError:
        return None  # the rank reports the syntax error as it always does
    found = _first_await(tree)
    return found.lineno if found is not None else None


def _first_await(node: ast.AST) -> ast.AST | None:
    if isinstance(node, (ast.Await, ast.AsyncFor, ast.AsyncWith)):
        return node
    if isinstance(node, ast.comprehension) and node.is_async:
        return node.iter
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        return None  # an await in there runs only when the function is called
    for child in ast.iter_child_nodes(node):
        found = _first_await(child)
        if found is not None:
            return found
    return None


def refusal(line: int) -> str:
    return (
        f"Line {line} awaits at the top level of the cell, which the ranks' engines never "
        f"answer (the cell would hang). Put it in a function and run that on a fresh event "
        f"loop: async def main(): ...; then {INSTEAD}"
    )
