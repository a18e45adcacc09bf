"""Every rank names the running cell as the notebook does, ``In[7]``, in tracebacks and in
warnings. Runs inside each engine.

Without it a rank names a cell by its own count of cells run (which differs between ranks
that ran different subsets) in tracebacks, and by its own temporary file in warnings
(``/tmp/ipykernel_<pid>/<hash>.py:2``: a different pid on every rank), so the same warning
on 64 ranks was 64 different lines. The kernel sends the notebook's name for the cell as
the execute request's label (ipyparallel 9 keeps it in the request's metadata); IPython
names a cell in tracebacks from ``compile._filename_map`` (IPython/core/compilerop.py,
``format_code_name``), which ``cache`` fills as the cell is compiled.

Lines are counted as the notebook's editor counts them (core/cell_lines.py): the label
says where the code starts, and the cell is compiled and cached (``linecache``) after as
many blank lines, so tracebacks, warnings, SyntaxErrors and pdb all name the editor's line.
"""

from __future__ import annotations

import linecache
import warnings

from ..core import cell_lines

_state: dict = {}
_shift: dict[str, int] = {}  # a cell's file name -> the editor lines before its code


def install(shell) -> bool:
    """Hook the shell's cell compiler and the warnings' format; whether both are in place."""
    if "installed" in _state:
        return _state["installed"]
    compiler = getattr(shell, "compile", None)
    ok = compiler is not None and isinstance(getattr(compiler, "_filename_map", None), dict)
    if ok:
        _hook_cache(shell, compiler)
        _hook_parse(compiler)
        _hook_warnings(compiler)
        _hook_debugger(compiler)
    _state["installed"] = ok
    return ok


def notebook_number(shell) -> int | None:
    """The notebook's number for the request being run, from its label, if it has one."""
    where = _where(shell)
    return where[0] if where else None


def _where(shell) -> tuple[int, int] | None:
    """(notebook number, the editor line its code starts on), from the request's label."""
    return cell_lines.parse(str((_request(shell).get("metadata") or {}).get("label") or ""))


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
        where = _where(shell)
        _shift.pop(name, None)
        if where is not None:
            compiler._filename_map[name] = where[0]
            raw = transformed_code if raw_code is None else raw_code
            shift = where[1] - 1 + cell_lines.leading_blank_lines(raw)
            entry = linecache.cache.get(name)
            if shift > 0 and entry is not None:
                _shift[name] = shift
                linecache.cache[name] = (*entry[:2], ["\n"] * shift + entry[2], *entry[3:])
        return name

    compiler.cache = cache


def _hook_parse(compiler) -> None:
    """The cell's code parsed after its editor lines before it: every line number of its
    code objects, and of a SyntaxError, is the editor's. A SyntaxError names the cell as
    the notebook does (its text said the temporary file's name)."""
    original = compiler.ast_parse

    def ast_parse(source, filename="<unknown>", symbol="exec"):
        try:
            return original("\n" * _shift.get(filename, 0) + source, filename, symbol)
        except SyntaxError as e:
            number = compiler._filename_map.get(filename)
            if number is not None and e.filename == filename:
                e.filename = f"In[{number}]"  # shown as "Cell In[7], line 3" still:
                compiler._filename_map.setdefault(e.filename, number)  # format_code_name
            raise

    compiler.ast_parse = ast_parse


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
