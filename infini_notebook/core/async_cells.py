"""Cells with top-level ``await``: ipyparallel's engines (9.2) take such a cell and never
reply, so it would hang until interrupted. They are refused before they are sent, saying
what works instead. Pure: the cell's Python source in, the line of its first top-level await
(or ``async for``/``async with``) out."""

from __future__ import annotations

import ast
import inspect

# What runs a coroutine on a rank: the engine's own event loop is busy running the cell, so
# asyncio.run() there raises; a fresh loop on a worker thread does not.
INSTEAD = "concurrent.futures.ThreadPoolExecutor(1).submit(asyncio.run, main()).result()"
IMPORTS = "import asyncio, concurrent.futures"


def top_level_await(source: str) -> int | None:
    """The line of the first ``await``, ``async for``, ``async with`` or async comprehension
    that runs as the cell runs (outside function bodies; decorators, default values and
    annotations do run); None when there is none (or the source does not parse). The
    verdict is the compiler's, as IPython's own ``should_run_async``: code compiled with
    top-level await allowed is a coroutine exactly when it awaits."""
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    try:
        # dont_inherit: this module's own `from __future__ import annotations` is not the cell's
        code = compile(source, "<cell>", "exec", flags=flags, dont_inherit=True)
    except SyntaxError:
        return None  # the rank reports the syntax error as it always does
    if not code.co_flags & inspect.CO_COROUTINE:
        return None
    tree = compile(source, "<cell>", "exec", flags=flags | ast.PyCF_ONLY_AST, dont_inherit=True)
    found = _first_await(tree)
    return found.lineno if found is not None else 1


def _first_await(node: ast.AST) -> ast.AST | None:
    if isinstance(node, (ast.Await, ast.AsyncFor, ast.AsyncWith)):
        return node
    if isinstance(node, ast.comprehension) and node.is_async:
        return node.iter
    children: list = list(ast.iter_child_nodes(node))
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        # the body runs when called; decorators, defaults, annotations as it is defined
        children = [*node.decorator_list, node.args, *([node.returns] if node.returns else [])]
    elif isinstance(node, ast.Lambda):
        children = [node.args]
    for child in children:
        found = _first_await(child)
        if found is not None:
            return found
    return None


def refusal(line: int) -> str:
    return (
        f"Line {line} awaits at the top level of the cell, which the ranks' engines never "
        f"answer (the cell would hang). Put it in a function and run that on a fresh event "
        f"loop: async def main(): ...; then {IMPORTS}; {INSTEAD}"
    )
