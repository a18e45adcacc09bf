"""infini_notebook: interactive multi-GPU (or CPU) torch.distributed sessions in Jupyter.

    %load_ext infini_notebook
    %dist_start --nprocs 4
    %%dist
    ...

or, without IPython: ``session = infini_notebook.start(nprocs=4); session.run("...")``.
Importing this package stays light (no torch): engines import it too.
"""

import logging

from .core.errors import DistCellError, DistUsageError

# Quiet by default (ipyparallel's launchers log through us); users opt in with a handler.
logging.getLogger("infini_notebook").addHandler(logging.NullHandler())

__all__ = ["DistCellError", "DistUsageError", "start", "current", "load_ipython_extension"]


def start(**options):
    """Start a session (see ``%dist_start?`` for the options)."""
    from .cluster import start as _start

    return _start(**options)


def current():
    """The running session, or None."""
    from .cluster import current as _current

    return _current()


def load_ipython_extension(ipython) -> None:
    from .core.export import record_outcome
    from .debug_magics import DebugMagics
    from .keep_magics import KeepMagics, record_cell
    from .layout_magics import LayoutMagics
    from .magics import DistMagics

    ipython.register_magics(DistMagics)
    ipython.register_magics(DebugMagics)
    ipython.register_magics(KeepMagics)
    ipython.register_magics(LayoutMagics)
    from .kernel import debug_proxy

    debug_proxy.install(getattr(ipython, "kernel", None), current)  # JupyterLab's debugger on ranks
    if current() is None:
        from .launch.prewarm import warm

        warm()  # the first %dist_start then finds its template's imports done
    if record_outcome not in ipython.events.callbacks["post_run_cell"]:
        ipython.events.register("post_run_cell", record_outcome)  # %dist_export skips failures
    if record_cell not in ipython.events.callbacks["post_run_cell"]:
        ipython.events.register("post_run_cell", record_cell)  # a kept session's history


def __getattr__(name):  # lazy: ParallelLayout without importing torch.distributed
    if name == "ParallelLayout":
        from .core.layout import ParallelLayout

        return ParallelLayout
    raise AttributeError(name)
