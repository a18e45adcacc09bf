"""The ipyparallel launchers whose processes the warm template forks (see template.py;
template_client.py starts the template and talks to it).

ipyparallel stays in charge of everything but the fork: registration, signing, stopping.
``TemplateEngineSetLauncher`` is ipyparallel's local engine-set launcher whose engines are
forked by the template instead of started by ``Popen``; an engine the template cannot fork
(it refused, or it is gone) is started by ``Popen`` as usual, and the set records which way
each came up (``how``). ``TemplateControllerLauncher`` does the same for the controller.
"""

from __future__ import annotations

import json
import os
import select
import socket
import sys

import psutil
from ipyparallel.cluster.launcher import (
    LocalControllerLauncher,
    LocalEngineLauncher,
    LocalEngineSetLauncher,
)
from traitlets import Unicode

from .template_client import TemplateUnavailable, read_line, request, socket_problem

FORKED = "forked from the warm template"


class Forked:
    """A local process launcher's process, forked by the template at ``template_path()``
    (started by Popen when the template cannot: ``how`` says which). Its exit code comes
    from the template, its parent (psutil cannot tell it for a process not our child)."""

    how = ""  # FORKED, or why the process was started the usual way
    op = ""  # the template's request that forks it

    def template_path(self) -> str:
        raise NotImplementedError

    def expected_cmd(self) -> list[str]:
        """``-m MODULE``: what the command must run for the template to fork it instead."""
        raise NotImplementedError

    def start(self):
        try:
            pid = self.fork(self.template_path())
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
        cmd, expected = list(self.find_args()), self.expected_cmd()
        same_python = os.path.realpath(cmd[0]) == os.path.realpath(sys.executable)
        if not same_python or cmd[1 : len(expected) + 1] != expected:
            raise TemplateUnavailable(f"a custom command ({' '.join(cmd)})")
        req = {
            "op": self.op,
            "argv": cmd[len(expected) + 1 :],
            "env": dict(os.environ, **self.get_env()),
            "cwd": os.path.abspath(self.work_dir),
            "output": self.output_file,
        }
        return int(request(socket_path, req)["pid"])

    def _wait(self):
        if self.how != FORKED:
            return super()._wait()
        exit_code = None
        try:
            exit_code = self.wait_exit()
        except (TemplateUnavailable, ConnectionError, OSError):
            self.wait_orphan()
        stop_data = dict(exit_code=exit_code, pid=self.pid, identifier=self.identifier)
        self.loop.add_callback(lambda: self.notify_stop(stop_data))

    def wait_orphan(self) -> None:
        """The template died before the process: until it (now init's child) ends too; its
        exit code went with the template. Reporting it stopped while it runs lost
        ipyparallel's hold of it (a spare engine outlived its session). Its pidfd becomes
        readable when it ends, a zombie still: psutil's wait for a process that is not its
        child lasts until the pid is gone, and PID 1 took 1.5 s to reap it (a stop took
        that long) or may never."""
        try:
            if not self.process.is_running():  # psutil's check also sees a reused pid
                return
            fd = os.pidfd_open(self.pid)
        except (OSError, psutil.Error):  # gone already
            return
        try:
            while not self._stop_waiting.is_set():
                if select.select([fd], [], [], 1.0)[0]:
                    return
        finally:
            os.close(fd)

    def wait_exit(self) -> int | None:
        problem = socket_problem(self.template_path())
        if problem:  # never a request to a socket we did not check
            raise OSError(f"the template's socket is refused: {problem}")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(self.template_path())
            conn.sendall(json.dumps({"op": "wait", "pid": self.pid}).encode() + b"\n")
            conn.settimeout(1.0)
            while not self._stop_waiting.is_set() and self.state == "running":
                try:
                    return read_line(conn)["exit_code"]
                except TimeoutError:
                    continue
        return None


class TemplateEngineLauncher(Forked, LocalEngineLauncher):
    """One engine, forked by the template; started by Popen if the template cannot."""

    op = "fork"

    def template_path(self) -> str:
        return self.parent.template_socket

    def expected_cmd(self) -> list[str]:
        return ["-m", "ipyparallel.engine"]


class TemplateControllerLauncher(Forked, LocalControllerLauncher):
    """The controller, forked by the template at ``template_socket``; started by Popen if
    there is none or it cannot."""

    op = "controller"
    entrypoint_name = f"{__name__}.TemplateControllerLauncher"  # as for the engine set
    template_socket = Unicode("", config=True, help="the template's socket ('' : none)")

    def template_path(self) -> str:
        return self.template_socket

    def expected_cmd(self) -> list[str]:
        return ["-m", "infini_notebook.launch.controller"]


class TemplateEngineSetLauncher(LocalEngineSetLauncher):
    """ipyparallel's local engine set, forked from the warm template at ``template_socket``."""

    launcher_class = TemplateEngineLauncher
    # How ipyparallel's cluster file names this class, for Cluster.from_file (a kept
    # session attached, see keep.py): its "module:Class" default is not importable there.
    entrypoint_name = f"{__name__}.TemplateEngineSetLauncher"
    template_socket = Unicode("", config=True, help="the template's socket ('' : none)")

    def how(self) -> list[str]:
        """How each engine came up: FORKED, or why not."""
        return [el.how for el in self.launchers.values()]
