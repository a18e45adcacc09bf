"""A rank's side of JupyterLab's debugger (issue 52): its debugger behind a signed relay, and
the source files its breakpoints need. Runs inside each engine; the kernel's proxy
(kernel/debug_proxy.py) talks the Debug Adapter Protocol to it through the relay
(engine/dap_relay.py, core/dap_frames.py), never to a port that answers anyone.

Once a client attached, pydevd traces the rank's threads. Threads of our own (rank services,
ipykernel's and ipyparallel's) are marked as pydevd's own (``is_pydev_daemon_thread``, read
by ``PyDB`` in pydevd.py when it suspends "all" threads, and ``pydev_do_not_trace``): while
the cell's thread is paused at a breakpoint they keep answering the kernel (stacks, waits,
telemetry, heartbeats).
"""

from __future__ import annotations

import os
import socket
import sys
import threading

_state: dict = {}  # "relay": the Relay once started


def listen(key: str, toward: str) -> dict:
    """Start this rank's debugger behind its relay (once per process), on loopback, or on
    the address by which this host reaches ``toward`` (the kernel's store host) for a rank
    of another host; where to link and how this rank names its cells' files (ipykernel's
    compiler: its tmp folder + a hash of the code)."""
    from ipykernel.compiler import get_tmp_directory

    from . import dap_relay

    if "relay" not in _state:
        _spare_service_threads()
        _state["relay"] = dap_relay.Relay(key, address_toward(toward))
    host, port = _state["relay"].endpoint
    return {
        "host": host,
        "port": int(port),
        "pid": os.getpid(),
        "cwd": os.getcwd(),
        "prefix": get_tmp_directory() + os.sep,
        "main_thread": threading.main_thread().name,
    }


def address_toward(host: str) -> str:
    """This host's own address on the route to ``host`` (loopback for a local kernel):
    a UDP socket's connect sends nothing, it only picks the route."""
    family, _, _, _, addr = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(addr)
        return probe.getsockname()[0]


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
    from .remote_start import refuse_shared_tmp

    folder = get_tmp_directory()  # /tmp/ipykernel_<pid>: one another user could make first
    # in a TMPDIR others may write without the sticky bit, they could rename our folder
    # and put their text where the debugger and tracebacks read the cell: refused
    refuse_shared_tmp(os.path.dirname(folder))
    os.makedirs(folder, mode=0o700, exist_ok=True)
    # through a directory fd checked to be ours, an O_EXCL|O_NOFOLLOW temporary renamed
    return write_text(folder, os.path.basename(get_file_name(body)), text)


def files_with_text(text: str) -> list[str]:
    """The source files with exactly ``text``: among the modules this rank imported and
    the .py files of its working folder (JupyterLab's file editor sends only the text of the
    file whose breakpoints it sets). Sizes first: a file is read only when its size fits."""
    data = text.encode()
    cwd = os.getcwd()
    candidates = [getattr(m, "__file__", None) for m in list(sys.modules.values())]
    candidates += [os.path.join(cwd, n) for n in sorted(os.listdir(cwd)) if n.endswith(".py")]
    out: list[str] = []
    for path in dict.fromkeys(p for p in candidates if isinstance(p, str) and p.endswith(".py")):
        try:
            if os.stat(path).st_size != len(data):
                continue
            with open(path, "rb") as f:
                same = f.read(len(data) + 1) == data
        except OSError:
            continue
        if same and os.path.realpath(path) not in out:
            out.append(os.path.realpath(path))
    return out
