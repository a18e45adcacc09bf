"""Every rank names the running cell as the notebook does, ``In[7]``, in tracebacks and in
warnings. Runs inside each engine.

Without it a rank names a cell by its own count of cells run (which differs between ranks
that ran different subsets) in tracebacks, and by its own temporary file in warnings
(``/tmp/ipykernel_<pid>/<hash>.py:2``: a different pid on every rank), so the same warning
on 64 ranks was 64 different lines. The kernel sends the notebook's name for the cell as
the execute request's label (ipyparallel 9 keeps it in the request's metadata); IPython
names a cell in tracebacks from ``compile._filename_map`` (IPython/core/compilerop.py,
``format_code_name``), which ``cache`` fills as the cell is compiled.
"""

from __future__ import annotations

import linecache
import re
import warnings

_LABEL = re.compile(r"In\[(\d+)\]")
_state: dict = {}


def install(shell) -> bool:
    """Hook the shell's cell compiler and the warnings' format; whether both are in place."""
    if "installed" in _state:
        return _state["installed"]
    compiler = getattr(shell, "compile", None)
    ok = compiler is not None and isinstance(getattr(compiler, "_filename_map", None), dict)
    if ok:
        _hook_cache(shell, compiler)
        _hook_warnings(compiler)
        _hook_debugger(compiler)
    _state["installed"] = ok
    return ok


def notebook_number(shell) -> int | None:
    """The notebook's number for the request being run, from its label, if it has one."""
    match = _LABEL.fullmatch(str((_request(shell).get("metadata") or {}).get("label") or ""))
    return int(match.group(1)) if match else None


def request_id(shell) -> str | None:
    """The id of the request being run: the controller keeps its output under it (a kernel
    attaching a kept session reads what a cell printed while none was attached)."""
    return (_request(shell).get("header") or {}).get("msg_id")


def _request(shell) -> dict:
    try:
        return shell.kernel.get_parent("shell") or {}
    except Exception:  # not in a kernel, or an ipykernel without get_parent
        return {}


def _hook_cache(shell, compiler) -> None:
    original = compiler.cache

    def cache(transformed_code, number=0, raw_code=None):
        name = original(transformed_code, number, raw_code)
        ours = notebook_number(shell)
        if ours is not None:
            compiler._filename_map[name] = ours
        return name

    compiler.cache = cache


def _hook_warnings(compiler) -> None:
    """warnings.formatwarning, replaced: Python calls the replacement (``_formatwarnmsg``
    in Lib/warnings.py) with the file name, which for a cell becomes ``In[7]``."""
    original = warnings.formatwarning

    def formatwarning(message, category, filename, lineno, line=None):
        if filename in compiler._filename_map:
            if line is None:  # read under the file's real name, not the shown one
                line = linecache.getline(filename, lineno)
            filename = f"In[{compiler._filename_map[filename]}]"
        return original(message, category, filename, lineno, line)

    warnings.formatwarning = formatwarning


def _hook_debugger(compiler) -> None:
    """pdb's frame lines (``> In[7](2)<module>()``) name a cell as the notebook does: bdb's
    ``format_stack_entry`` (Lib/bdb.py) writes the file's canonic name, the temporary file.
    Only the line shown changes: breakpoints still take the file's real name."""
    import bdb

    original = bdb.Bdb.format_stack_entry

    def format_stack_entry(self, frame_lineno, lprefix=": "):
        text = original(self, frame_lineno, lprefix)
        filename = frame_lineno[0].f_code.co_filename
        number = compiler._filename_map.get(filename)
        if number is None:
            return text
        return text.replace(self.canonic(filename), f"In[{number}]", 1)

    bdb.Bdb.format_stack_entry = format_stack_entry
