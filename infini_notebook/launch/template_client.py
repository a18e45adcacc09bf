"""The kernel's side of talking to the warm template (see template.py): starting it, waiting
until it listens, and one request with its reply. Light (no ipyparallel): ``%load_ext`` starts a
template through it (see prewarm.py); template_launcher.py is the engine launcher that forks
through it.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time

import psutil

from .watchdog import MARK

READY_TIMEOUT_S = 120.0  # the template's imports, on a loaded machine


class TemplateUnavailable(RuntimeError):
    """The template cannot fork an engine now; the message says why."""


def start_template(env: dict, profile_dir: str, socket_path: str, log_path: str) -> psutil.Process:
    """``python -m infini_notebook.launch.template`` with ``env`` and the session's mark. One BLAS
    thread: numpy's OpenBLAS otherwise starts a pool at import, and a process with threads
    must not fork (torch's own pools start later, in each engine)."""
    env = dict(env, **{MARK: profile_dir, "OPENBLAS_NUM_THREADS": "1"})
    with open(log_path, "ab") as out, open(os.devnull, "rb") as null:
        proc = subprocess.Popen(
            [sys.executable, "-m", "infini_notebook.launch.template", socket_path],
            stdin=null,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # the kernel's SIGINT is not the template's
        )
    return psutil.Process(proc.pid)


def socket_problem(socket_path: str) -> str | None:
    """Why ``socket_path`` is not our template's socket (a link, not a socket, another
    user's), or None. Checked before every request: a fork request carries the kernel's
    whole environment and the ipyparallel key, and goes to no socket we did not check."""
    try:
        st = os.lstat(socket_path)
    except OSError as e:
        return f"{socket_path}: {e.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return f"{socket_path} is a symbolic link"
    if not stat.S_ISSOCK(st.st_mode):
        return f"{socket_path} is not a socket"
    if st.st_uid != os.geteuid():
        return f"{socket_path} belongs to uid {st.st_uid}, not to this user"
    return None


def request(socket_path: str, req: dict, timeout: float | None = 30.0) -> dict:
    """One request, its reply; TemplateUnavailable if the template cannot answer, or its
    socket is not one of ours (nothing is sent then)."""
    problem = socket_problem(socket_path)
    if problem:
        raise TemplateUnavailable(f"the template's socket is refused: {problem}")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout)
            conn.connect(socket_path)
            conn.sendall(json.dumps(req).encode() + b"\n")
            reply = read_line(conn)
    except OSError as e:
        raise TemplateUnavailable(f"the template did not answer ({e})") from None
    except ValueError as e:  # not JSON: whatever it is, the engine starts the usual way
        raise TemplateUnavailable(f"the template answered garbage ({e})") from None
    if not isinstance(reply, dict):
        raise TemplateUnavailable(f"the template answered {reply!r}")
    if "error" in reply:
        raise TemplateUnavailable(reply["error"])
    return reply


def read_line(conn: socket.socket) -> dict:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            raise ConnectionError("the template closed the connection")
        data += chunk
    return json.loads(data)


def wait_ready(proc: psutil.Process, socket_path: str, timeout: float = READY_TIMEOUT_S) -> None:
    """Until the template listens (its imports done); TemplateUnavailable if it died."""
    deadline = time.monotonic() + timeout
    while not os.path.lexists(socket_path):
        if not alive(proc):
            raise TemplateUnavailable("the template exited while importing (see its log)")
        if time.monotonic() > deadline:
            raise TemplateUnavailable(f"the template was not ready in {timeout:.0f}s")
        time.sleep(0.02)
    problem = socket_problem(socket_path)
    if problem:
        raise TemplateUnavailable(f"the template's socket is refused: {problem}")


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
