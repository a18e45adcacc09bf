"""Kernel side of the warm template (see template.py): starting it, asking it to fork, and
the ipyparallel engine launcher that uses it.

ipyparallel stays in charge of everything but the fork: the controller, registration,
signing, stopping. ``TemplateEngineSetLauncher`` is ipyparallel's local engine-set launcher
whose engines are forked by the template instead of started by ``Popen``; an engine the
template cannot fork (it refused, or it is gone) is started by ``Popen`` as usual, and the
set records which way each came up (``how``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import psutil
from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher
from traitlets import Unicode

from .watchdog import MARK

FORKED = "forked from the warm template"
READY_TIMEOUT_S = 120.0  # the template's imports, on a loaded machine


class TemplateUnavailable(RuntimeError):
    """The template cannot fork an engine now; the message says why."""


def start_template(env: dict, profile_dir: str, socket_path: str, log_path: str) -> psutil.Process:
    """``python -m infini_notebook.template`` with ``env`` and the session's mark. One BLAS
    thread: numpy's OpenBLAS otherwise starts a pool at import, and a process with threads
    must not fork (torch's own pools start later, in each engine)."""
    env = dict(env, **{MARK: profile_dir, "OPENBLAS_NUM_THREADS": "1"})
    with open(log_path, "ab") as out, open(os.devnull, "rb") as null:
        proc = subprocess.Popen(
            [sys.executable, "-m", "infini_notebook.template", socket_path],
            stdin=null,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # the kernel's SIGINT is not the template's
        )
    return psutil.Process(proc.pid)


def request(socket_path: str, req: dict, timeout: float | None = 30.0) -> dict:
    """One request, its reply; TemplateUnavailable if the template cannot answer."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout)
            conn.connect(socket_path)
            conn.sendall(json.dumps(req).encode() + b"\n")
            reply = read_line(conn)
    except OSError as e:
        raise TemplateUnavailable(f"the template did not answer ({e})") from None
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
    while not os.path.exists(socket_path):
        if not alive(proc):
            raise TemplateUnavailable("the template exited while importing (see its log)")
        if time.monotonic() > deadline:
            raise TemplateUnavailable(f"the template was not ready in {timeout:.0f}s")
        time.sleep(0.02)


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class TemplateEngineLauncher(LocalEngineLauncher):
    """One engine, forked by the template; started by Popen if the template cannot."""

    how = ""  # FORKED, or why the engine was started the usual way

    def start(self):
        parent = self.parent
        try:
            pid = self.fork(parent.template_socket)
        except TemplateUnavailable as e:
            self.how = str(e)
            return super().start()
        self.how = FORKED
        self.pid = pid
        self.process = psutil.Process(pid)
        self.notify_start(pid)
        self._start_waiting()

    def fork(self, socket_path: str) -> int:
        if not socket_path:
            raise TemplateUnavailable("no template")
        cmd = list(self.engine_cmd)
        if cmd[1:] != ["-m", "ipyparallel.engine"]:
            raise TemplateUnavailable(f"a custom engine command ({' '.join(cmd)})")
        env = dict(os.environ, **self.get_env())
        req = {
            "op": "fork",
            "argv": self.cluster_args + self.engine_args,
            "env": env,
            "cwd": os.path.abspath(self.work_dir),
            "output": self.output_file,
        }
        return int(request(socket_path, req)["pid"])

    def _wait(self):
        """The exit code comes from the template, the engine's parent (psutil cannot tell
        it for a process that is not our child)."""
        if self.how != FORKED:
            return super()._wait()
        exit_code = None
        try:
            exit_code = self.wait_exit()
        except (TemplateUnavailable, ConnectionError, OSError):
            pass
        stop_data = dict(exit_code=exit_code, pid=self.pid, identifier=self.identifier)
        self.loop.add_callback(lambda: self.notify_stop(stop_data))

    def wait_exit(self) -> int | None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(self.parent.template_socket)
            conn.sendall(json.dumps({"op": "wait", "pid": self.pid}).encode() + b"\n")
            conn.settimeout(1.0)
            while not self._stop_waiting.is_set() and self.state == "running":
                try:
                    return read_line(conn)["exit_code"]
                except TimeoutError:
                    continue
        return None


class TemplateEngineSetLauncher(LocalEngineSetLauncher):
    """ipyparallel's local engine set, forked from the warm template at ``template_socket``."""

    launcher_class = TemplateEngineLauncher
    template_socket = Unicode("", config=True, help="the template's socket ('' : none)")

    def how(self) -> list[str]:
        """How each engine came up: FORKED, or why not."""
        return [el.how for el in self.launchers.values()]
