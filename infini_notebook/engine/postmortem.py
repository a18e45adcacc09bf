"""Post-mortem on a rank (``%dist_debug``): remember the exception of the last cell that
failed, find its frame among the user's own cells, run code there as a REPL would."""

from __future__ import annotations

# This engine's last cell failure (None after a cell that succeeded) and its IPython hook.
_FAILURES: dict = {}


def remember_failures() -> None:
    """Keep the exception of the last cell that failed (None after one that succeeded) for
    ``post_mortem``: sys.last_traceback alone is overwritten by any failing apply, such as
    a %dist_pull of a missing name."""
    if "failure_hook" in _FAILURES:  # once per engine process
        return
    from IPython import get_ipython

    def after_cell(result) -> None:
        if _FAILURES.pop("keep", False):  # a post-mortem's own cell: not the user's
            return
        _FAILURES["failure"] = result.error_in_exec or result.error_before_exec

    get_ipython().events.register("post_run_cell", after_cell)
    _FAILURES["failure_hook"] = after_cell


def post_mortem(code: str) -> str:
    """Run ``code`` in the frame where this rank's last cell failed; its printed output
    (and the last expression's repr) come back as text."""
    _, frame = _last_failure()
    return run_in_frame(code, frame)


# The cell %dist_debug runs on a rank for an interactive post-mortem
DEBUG_CELL = "import infini_notebook.engine.postmortem as _pm; _pm.debug_last_failure(); del _pm"


def debug_last_failure() -> None:
    """pdb post-mortem of this rank's last failed cell, starting in its failing frame
    (``%dist_debug`` with no code). Runs as a cell of its own, whose prompts the notebook
    answers (stdin_relay); the failure stays for the next post-mortem."""
    import bdb
    import pdb

    error, frame = _last_failure()
    _FAILURES["keep"] = True

    class AtFailingFrame(pdb.Pdb):
        def setup(self, f, tb):
            super().setup(f, tb)
            for i, (entry, _) in enumerate(self.stack):
                if entry is frame:  # not the innermost (torch's): the user's own line
                    self.curindex, self.curframe = i, entry
                    self.curframe_locals = entry.f_locals

    debugger = AtFailingFrame()
    debugger.reset()
    try:
        debugger.interaction(None, error.__traceback__)
    except bdb.BdbQuit:  # q: the post-mortem is over, nothing failed
        pass


def _last_failure():
    """This rank's last failure and the frame to inspect it in."""
    from IPython import get_ipython

    error = _FAILURES.get("failure")
    if error is None:
        raise RuntimeError("the last cell on this rank did not fail: no frame to inspect")
    compiler = get_ipython().compile
    frame = failing_frame(error.__traceback__, lambda f: compiler.format_code_name(f) is not None)
    if frame is None:  # a SyntaxError: the cell never ran
        raise RuntimeError(f"the last cell failed before running ({type(error).__name__})")
    return error, frame


def failing_frame(tb, is_cell_file):
    """The innermost frame of the user's own cells in traceback ``tb`` (not torch's or our
    plumbing's), else the innermost frame; None for an empty traceback."""
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    cells = [f for f in frames if is_cell_file(f.f_code.co_filename)]
    return (cells or frames or [None])[-1]


def run_in_frame(code: str, frame) -> str:
    """Exec ``code`` over a copy of the frame's globals and locals (one namespace, so that
    comprehensions see the locals), as a REPL would: stdout and the last expression's repr
    are returned. Assignments stay in the copy."""
    import ast
    import contextlib
    import io

    tree = ast.parse(code, "<post-mortem>", "exec")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    ns = {**frame.f_globals, **frame.f_locals}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(tree, "<post-mortem>", "exec"), ns)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<post-mortem>", "eval"), ns)
            if value is not None:
                print(repr(value))
    return out.getvalue()
