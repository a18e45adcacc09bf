"""A rank's side of JupyterLab's debugger (issue 52): debugpy listening on loopback, and the
source files its breakpoints need. Runs inside each engine; the kernel's proxy
(kernel/debug_proxy.py) talks the Debug Adapter Protocol to it.

debugpy ships with ipykernel. ``debugpy.listen`` (debugpy/public_api.py) starts its adapter
process and returns the port clients attach to; once a client attached, pydevd traces the
rank's threads. Threads of our own (rank services, ipykernel's and ipyparallel's) are
marked as pydevd's own (``is_pydev_daemon_thread``, read by ``PyDB`` in pydevd.py when it
suspends "all" threads, and ``pydev_do_not_trace``): while the cell's thread is paused at a
breakpoint they keep answering the kernel (stacks, waits, telemetry, heartbeats).
"""

from __future__ import annotations

import os
import threading

_state: dict = {}  # "endpoint": (host, port) once listening


def listen() -> dict:
    """Start debugpy on loopback (once per process); where to attach and how this rank
    names its cells' files (ipykernel's compiler: its tmp folder + a hash of the code)."""
    from ipykernel.compiler import get_tmp_directory

    if "endpoint" not in _state:
        import debugpy

        _spare_service_threads()
        # a process the cell starts (a DataLoader's workers, a subprocess) runs undebugged:
        # under debugpy's default it would wait for a client that never comes
        # (kernel/debug_proxy.no_child_debugging says how)
        debugpy.configure(subProcess=False)
        _state["endpoint"] = debugpy.listen(("127.0.0.1", 0))
    host, port = _state["endpoint"]
    return {
        "host": host,
        "port": int(port),
        "pid": os.getpid(),
        "cwd": os.getcwd(),
        "prefix": get_tmp_directory() + os.sep,
        "main_thread": threading.main_thread().name,
    }


def _spare_service_threads() -> None:
    """Every thread but the cell's (the main thread) keeps running while the rank is
    paused: pydevd neither suspends nor traces threads carrying these attributes."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread():
            thread.is_pydev_daemon_thread = True
            thread.pydev_do_not_trace = True


def cell_file(body: str, text: str) -> str:
    """Write ``text`` (the notebook cell as the editor shows it, so its line N is the
    editor's line N, as engine/cell_names.py numbers the compiled cell) where this rank
    compiles ``body``: ipykernel's ``XCachingCompiler.get_code_name`` ->
    ``compiler.get_file_name`` (ipykernel/compiler.py). pydevd refuses a breakpoint in a
    file that does not exist (``PyDevdAPI.add_breakpoint``, ADD_BREAKPOINT_FILE_NOT_FOUND),
    as ipykernel's own ``dumpCell`` knows. Returns the path."""
    from ipykernel.compiler import get_file_name, get_tmp_directory

    from .own_files import write_text

    folder = get_tmp_directory()  # /tmp/ipykernel_<pid>: one another user could make first
    os.makedirs(folder, mode=0o700, exist_ok=True)
    # through a directory fd checked to be ours, an O_EXCL|O_NOFOLLOW temporary renamed
    return write_text(folder, os.path.basename(get_file_name(body)), text)
