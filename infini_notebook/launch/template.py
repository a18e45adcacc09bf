"""The warm template: a process that has imported torch, ipyparallel's engine and ours once,
and forks engines on request, so a rank starts without paying for ``import torch``.

Started by the session as ``python -m infini_notebook.launch.template SOCKET`` with the session's
mark in its environment (see watchdog.py): the watchdog and ``kill_leftovers`` find it and
every engine forked from it, whose /proc environment is the template's. It listens on a Unix
socket in the session folder and answers one JSON line per request:

- ``{"op": "fork", "argv": [...], "env": {...}, "cwd": ..., "output": PATH}``:
  ``{"pid": N}``, a new session leader that runs ``ipyparallel.engine`` with ``argv``;
- ``{"op": "controller", "argv": [...], "env": {...}, "cwd": ..., "output": PATH}``:
  ``{"pid": N}``, a new session leader that runs ipyparallel's controller (launch/
  controller.py) with ``argv``: a fresh interpreter spent ~0.3 s of every start importing it;
- ``{"op": "wait", "pid": N}``: ``{"exit_code": C}`` once that child ended (negative: the
  signal that ended it), as ``Popen.returncode`` would say;
- ``{"op": "nanny", "kwargs": B64_PICKLE, "fifo": PATH, "env": {...}}``: ``{"pid": N}``,
  ipyparallel's nanny for an engine (what ``ipyparallel.engine.nanny.start_nanny`` starts
  by Popen), its stdout the FIFO the engine reads, as the pipe Popen would have made;
- ``{"op": "info"}``: its pid, RSS and whether it may fork.

Forking is safe only from a process with one thread and no CUDA context: the template checks
both before every fork and refuses otherwise (the kernel then starts engines as usual).
A request it cannot read gets ``{"error": ...}`` too, and the template goes on serving.
The session ends it by pid at stop, the watchdog if the kernel dies.
"""

from __future__ import annotations

import gc
import json
import os
import selectors
import signal
import socket
import sys
from functools import partial

from .fork_safety import fork_refusal

READY = "template ready"  # printed once the imports are done and the socket listens
# What each request must carry; checked before anything is forked.
FIELDS = {
    "fork": ("argv", "env", "cwd", "output"),
    "controller": ("argv", "env", "cwd", "output"),
    "nanny": ("kwargs", "fifo", "env"),
    "wait": ("pid",),
}


def parse_request(line: bytes) -> dict:
    """A request line as a dict with what its op needs; ValueError says what is wrong."""
    req = json.loads(line)  # JSONDecodeError and UnicodeDecodeError are ValueErrors
    if not isinstance(req, dict) or not isinstance(req.get("op"), str):
        raise ValueError('not a JSON object with an "op"')
    missing = [name for name in FIELDS.get(req["op"], ()) if name not in req]
    if missing:
        raise ValueError(f"{req['op']!r} needs {', '.join(missing)}")
    if "pid" in req and (not isinstance(req["pid"], int) or isinstance(req["pid"], bool)):
        raise ValueError(f"pid {req['pid']!r} is not a number")
    return req


class Template:
    def __init__(self, path: str):
        self.path = path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path + ".tmp")
        self.listener.listen(64)
        os.rename(path + ".tmp", path)  # the path appears only once it accepts connections
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.buffers: dict[socket.socket, bytes] = {}
        self.exits: dict[int, int] = {}  # reaped children's exit codes
        self.waiters: dict[int, list[socket.socket]] = {}  # pid -> connections waiting

    def serve(self) -> None:
        while True:
            self.poll(0.05)
            self.reap()

    def poll(self, timeout: float) -> None:
        """New connections and requests, for up to ``timeout`` seconds."""
        for key, _ in self.selector.select(timeout=timeout):
            if key.fileobj is self.listener:
                conn, _ = self.listener.accept()
                self.selector.register(conn, selectors.EVENT_READ)
                self.buffers[conn] = b""
            else:
                self.read(key.fileobj)

    def read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(1 << 16)
        except OSError:  # the asker reset the connection
            data = b""
        if not data:
            self.drop(conn)
            return
        self.buffers[conn] += data
        while b"\n" in self.buffers.get(conn, b""):
            line, self.buffers[conn] = self.buffers[conn].split(b"\n", 1)
            self.answer(conn, line)

    def answer(self, conn: socket.socket, line: bytes) -> None:
        """One request. Whatever goes wrong is the asker's error reply: the other engines
        of the session, and its spares, still need this template."""
        try:
            req = parse_request(line)
        except ValueError as e:
            send(conn, {"error": f"the template could not read a request ({e})"})
            return
        try:
            self.handle(conn, req)
        except Exception as e:  # os.fork() out of memory or processes, say
            send(conn, {"error": f"the template failed at {req['op']!r}: {e}"})

    def handle(self, conn: socket.socket, req: dict) -> None:
        op = req.get("op")
        if op in ("fork", "nanny", "controller"):
            refusal = fork_refusal()
            child = {
                "fork": partial(become_engine, req, self.path),
                "nanny": partial(become_nanny, req),
                "controller": partial(become_controller, req),
            }[op]
            # A nanny runs none of the user's code, so it skips the exit hooks it inherited
            # (torch's library finalizers: ~25 ms of CPU per nanny at each stop or restart).
            reply = {"error": refusal} if refusal else {"pid": self.fork(child, op != "nanny")}
        elif op == "wait":
            pid = req["pid"]
            if pid not in self.exits:
                self.waiters.setdefault(pid, []).append(conn)
                return
            reply = {"exit_code": self.exits[pid]}
        elif op == "info":
            reply = {"pid": os.getpid(), "rss": rss(), "refusal": fork_refusal()}
        else:
            reply = {"error": f"unknown request {op!r}"}
        send(conn, reply)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.exits[pid] = os.waitstatus_to_exitcode(status)
            for conn in self.waiters.pop(pid, []):
                send(conn, {"exit_code": self.exits[pid]})

    def drop(self, conn: socket.socket) -> None:
        self.selector.unregister(conn)
        self.buffers.pop(conn, None)
        for waiting in self.waiters.values():
            if conn in waiting:
                waiting.remove(conn)
        conn.close()

    def fork(self, child, exit_hooks: bool = True) -> int:
        """A child that runs ``child()`` and exits as an interpreter would (without atexit
        hooks unless ``exit_hooks``); its pid."""
        sys.stdout.flush()
        sys.stderr.flush()
        # The template's objects (torch's: about a million) to the permanent generation:
        # a child's collections then skip them instead of writing to each one's header,
        # which copied the template's heap into every child page by page (an ended
        # engine's nanny spent seconds of CPU in its last collection; engines slowed too).
        gc.freeze()
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:  # the child: nothing of the template's serving may stay
            self.selector.close()
            for sock in [self.listener, *self.buffers]:
                sock.close()
            child()
            code = 0
        except SystemExit as e:  # how ipyparallel's engine ends
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:  # as an interpreter would end, without unwinding into the template's loop
            if exit_hooks:
                import atexit

                atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def become_engine(req: dict, template_socket: str) -> None:
    """In the forked child: the process ``Popen(argv, env=..., cwd=...,
    start_new_session=True)`` with output to ``req['output']`` would have been, then the
    engine, whose nanny the template forks too. Returns when the engine ends."""
    new_session(req["env"], stdin=os.devnull, stdout=req["output"])
    name_process(b"ipengine")
    os.chdir(req["cwd"])
    reseed()
    sys.argv = ["ipengine", *req["argv"]]
    from ipyparallel.engine import app

    app.start_nanny = partial(forked_nanny, template_socket)
    app.main()


def become_controller(req: dict) -> None:
    """In the forked child: what ``python -m infini_notebook.launch.controller ARGV`` started
    by Popen (as ipyparallel's controller launcher does) would have been. Returns when the
    controller ends."""
    new_session(req["env"], stdin=os.devnull, stdout=req["output"])
    name_process(b"ipcontroller")
    os.chdir(req["cwd"])
    sys.argv = ["ipcontroller", *req["argv"]]
    # its schedulers and heart monitor are forked (multiprocessing's default on Linux up to
    # Python 3.13) and inherit the patch; under forkserver they would run stock (slower only)
    from . import controller

    controller.patch()
    from ipyparallel.controller import app

    app.main()


def become_nanny(req: dict) -> None:
    """In the forked child: ipyparallel's nanny, as ``python -m ipyparallel.engine.nanny``
    with the engine's pickled arguments on stdin and the FIFO as its stdout."""
    import base64
    import pickle

    new_session(req["env"], stdin=os.devnull, stdout=req["fifo"], stderr=os.devnull)
    name_process(b"ipengine-nanny")
    kwargs = pickle.loads(base64.b64decode(req["kwargs"]))
    sys.stdout = os.fdopen(1, "w", buffering=1)  # the nanny writes its URL there
    kwargs["pipe"] = sys.stdout
    from ipyparallel.engine.nanny import KernelNanny

    KernelNanny.main(**kwargs)


def forked_nanny(template_socket: str, **kwargs):
    """``ipyparallel.engine.nanny.start_nanny`` for an engine forked from the template:
    the same nanny, forked by the template instead of started by Popen (a fresh interpreter
    importing ipyparallel cost each engine about a second of its start). Returns what
    start_nanny returns: the nanny's URL and what keeps its pipe open."""
    import base64
    import pickle

    kwargs["pid"] = os.getpid()
    fifo = os.path.join(os.path.dirname(template_socket), f"nanny-{os.getpid()}.fifo")
    os.mkfifo(fifo, 0o600)
    try:
        # Opened before the nanny opens its end, without blocking: a nanny that dies first
        # must not leave the engine waiting for ever.
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        req = {
            "op": "nanny",
            "kwargs": base64.b64encode(pickle.dumps(kwargs)).decode(),
            "fifo": fifo,
            "env": dict(os.environ, PYTHONUNBUFFERED="1"),
        }
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(template_socket)
            conn.sendall(json.dumps(req).encode() + b"\n")
            reply = json.loads(conn.makefile().readline() or "{}")
        if "pid" not in reply:
            os.close(fd)
            raise RuntimeError(f"nanny failed: {reply.get('error')}")
        url = read_url(fd)  # the nanny has opened the FIFO: its name can go
    finally:
        os.unlink(fifo)
    os.set_blocking(fd, True)
    return url, os.fdopen(fd, "rb")  # held open for the engine's life (see nanny.py)


def read_url(fd: int, timeout: float = 60.0) -> str:
    """The nanny's first line. Before the nanny opens its end a read finds nothing."""
    import time

    data, deadline = b"", time.monotonic() + timeout
    while not data.endswith(b"\n"):
        if time.monotonic() > deadline:
            raise RuntimeError("nanny failed: no address in time")
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            chunk = b""
        data += chunk
        if not chunk:
            time.sleep(0.005)
    return data.decode().strip()


def new_session(env: dict, stdin: str, stdout: str, stderr: str | None = None) -> None:
    """What ``Popen(..., env=env, start_new_session=True)`` gives a child: its own session
    (signals to the kernel's group do not reach it), default signal handlers, the given
    files as fd 0/1/2 and exactly ``env`` as its environment."""
    os.setsid()
    for signum in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for fd, path in ((0, stdin), (1, stdout), (2, stderr or stdout)):
        flags = os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_APPEND
        opened = os.open(path, flags if os.path.exists(path) else flags | os.O_CREAT, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    os.environ.clear()
    os.environ.update(env)


def name_process(name: bytes) -> None:
    """The name top and ``ps -o comm`` show (the command line stays the template's)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name, 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def reseed() -> None:
    """A fresh process draws its seeds from the OS; a forked one would repeat the
    template's. Python's ``random`` reseeds itself after fork; torch and numpy do not."""
    import torch

    torch.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def send(conn: socket.socket, reply: dict) -> None:
    try:
        conn.sendall(json.dumps(reply).encode() + b"\n")
    except OSError:
        pass  # the asker went away


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def warm_imports() -> None:
    """What every engine imports by the end of its bootstrap: torch (its process groups and
    DeviceMesh), ipyparallel's engine, ours."""
    import sqlite3  # noqa: F401

    import ipyparallel.controller.app  # noqa: F401  (a controller forked from here)
    import ipyparallel.engine.app  # noqa: F401

    # What each engine's kernel imports as it starts (about half a second of every start)
    import IPython.core.completerlib  # noqa: F401
    import IPython.core.logger  # noqa: F401
    import IPython.core.oinspect  # noqa: F401
    import IPython.extensions.storemagic  # noqa: F401
    import IPython.utils.wildcard  # noqa: F401
    import psutil  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.distributed.device_mesh  # noqa: F401
    import tornado.platform.asyncio  # noqa: F401
    import tornado.queues  # noqa: F401

    from .. import c10d, groups  # noqa: F401
    from ..core import layout, plan  # noqa: F401
    from ..engine import bootstrap  # noqa: F401

    if "numpy" in sys.modules:  # reseed() draws numpy's seed in each engine
        import numpy.random  # noqa: F401
    without_debugpy("ipykernel.debugger")


def without_debugpy(module: str) -> None:
    """Import ``module`` as if debugpy were not installed. ipykernel's debugger needs
    debugpy's, which starts a thread (the template could not fork) and costs each engine
    140 modules; an engine's kernel has no debug channel to use it (ipyparallel gives it
    none). A cell can still import debugpy itself: it is blocked only for this import."""
    import importlib

    if "debugpy" in sys.modules:
        return
    sys.modules["debugpy"] = None  # an import of it raises ImportError
    try:
        importlib.import_module(module)
    finally:
        del sys.modules["debugpy"]


def main(argv: list[str]) -> int:
    gc.disable()  # no collection while importing: it would leave holes in shared pages
    warm_imports()
    gc.freeze()
    gc.enable()
    template = Template(argv[0])
    print(READY, flush=True)
    try:
        template.serve()
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
