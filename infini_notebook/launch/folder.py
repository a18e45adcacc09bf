"""The session's folder and its guard: a 0700 folder in this user's private place
(private_place.py: never in a folder others can write) that only this session uses
(ipyparallel's profile, connection files, logs, stack dumps), the mark every process of the
session carries (the profile folder's path, see watchdog.MARK), and the watchdog that ends
those processes if the kernel dies. :class:`SessionFolder` is the only writer of all three."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from ..engine import shm_transport
from . import launchers, private_place
from .watchdog import remove_session_folder, remove_shared_files, wait_gone


class SessionFolder:
    """Made at once (or adopted from a template warmed ahead: see prewarm.py); removed by
    ``remove`` with its folder in /dev/shm."""

    def __init__(self, warmed=None):
        self.path: str = warmed.workdir if warmed else private_place.new_session_folder()
        # No process of this session is older: the watchdog ends only those started after.
        self.created: float = warmed.created if warmed else time.time()
        # a Popen of ours, or (a kept session attached) the watchdog as psutil sees it
        self._watchdog: subprocess.Popen | psutil.Process | None = (
            warmed.watchdog if warmed else None
        )
        self._shm_dir: str | None = None  # made at the first transfer: see shm_dir

    @property
    def profile_dir(self) -> str:
        """ipyparallel puts this in every process it launches (IPP_PROFILE_DIR): it marks
        the processes this session started, and only them (the folder is ours alone)."""
        return launchers.profile_dir(self.path)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def shm_dir(self) -> str | None:
        """The session's folder in /dev/shm for pull and push (mode 0700: only the kernel
        makes files there, see shm_transport), made at first use; None where /dev/shm
        cannot serve."""
        if self._shm_dir is None or not os.path.isdir(self._shm_dir):
            self._shm_dir = shm_transport.make_dir(self.path)
        return self._shm_dir

    def stack_file(self, rank: int, multi_host: bool) -> str | None:
        """Where a rank on this host dumps its stacks on STACK_SIGNAL (None: on another host)."""
        return None if multi_host else self.file(f"stacks-{rank}.txt")

    # ----- the watchdog -------------------------------------------------------------------
    def arm_watchdog(self) -> None:
        """A small process that ends ours if this kernel dies, even by SIGKILL. Armed before
        anything else starts, so a kernel killed while engines come up leaves nothing."""
        if self._watchdog is not None and _running(self._watchdog):
            return  # a hard restart keeps the session's watchdog (an adopted one too)
        self._watchdog = spawn_watchdog(self.profile_dir, self.created)

    def guard(self) -> psutil.Process:
        """The process a kept session's ranks and store host watch: its watchdog, which
        outlives the kernel (see keep.py)."""
        return psutil.Process(self._watchdog.pid)

    def reap_watchdog(self) -> None:
        """Collect the exit of this kernel's watchdog child, if it ended (a kept session
        stopped from another kernel): no zombie stays while this kernel lives."""
        if isinstance(self._watchdog, subprocess.Popen):
            self._watchdog.poll()

    def disarm_watchdog(self) -> None:
        if self._watchdog is not None:
            stop_watchdog(self._watchdog)
        self._watchdog = None

    # ----- the end ------------------------------------------------------------------------
    def remove_shared_files(self) -> None:
        """The files in the session's folder in /dev/shm (the kernel removes each after its
        transfer: this is for one it could not)."""
        shm_transport.clear_dir(self._shm_dir)

    def remove(self) -> None:
        remove_session_folder(self.path)  # with the folders it noted elsewhere
        remove_shared_files(self.path)  # and its folder in /dev/shm


def spawn_watchdog(profile_dir: str, since: float) -> subprocess.Popen:
    """``python -m infini_notebook.launch.watchdog`` for the processes marked ``profile_dir``
    started after ``since`` (see watchdog.py)."""
    kernel = psutil.Process()
    # Not the kernel's stdout and stderr: a kept session's watchdog outlives the kernel,
    # and whoever reads the kernel's pipes would wait for it to close them.
    with open(os.path.join(os.path.dirname(profile_dir), "watchdog.log"), "ab") as log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "infini_notebook.launch.watchdog",
                f"{kernel.pid}:{kernel.create_time()}",
                profile_dir,
                repr(since),
            ],
            start_new_session=True,  # a Ctrl-C meant for the kernel must not end it
            # -m imports from the working folder first: the session's (0700), not the
            # kernel's, which others may write (a notebook in /tmp)
            cwd=os.path.dirname(profile_dir),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )


def _running(watchdog) -> bool:
    if isinstance(watchdog, subprocess.Popen):
        return watchdog.poll() is None
    try:
        return watchdog.is_running() and watchdog.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stop_watchdog(watchdog) -> None:
    """End a watchdog that is no longer needed (a Popen, or a kept session's psutil.Process:
    the child of the kernel that started the session, maybe alive and not reaping it, so
    waited for by its exit, not by psutil's wait: see wait_gone)."""
    if _running(watchdog):
        try:
            watchdog.terminate()
            if isinstance(watchdog, subprocess.Popen):
                watchdog.wait(5)
            else:
                wait_gone([watchdog], 5)
        except (psutil.Error, subprocess.TimeoutExpired):
            pass
