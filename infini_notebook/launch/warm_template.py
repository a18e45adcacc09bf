"""The session's warm template (see template.py): started with the engines' environment,
waited for, measured and ended with what it forked. :class:`WarmTemplate` is the only
writer of the template's process and the environment it started with."""

from __future__ import annotations

import logging
import os

import psutil

from ..core.state import Progress
from . import launchers, template_client
from .watchdog import end_all

log = logging.getLogger("infini_notebook")


class WarmTemplate:
    def __init__(self, warmed=None, env: dict | None = None):
        """``warmed``: a template started ahead (see prewarm.py), adopted with the
        environment ``env`` the session's engines start with."""
        self._proc: psutil.Process | None = warmed.template if warmed else None
        self._env: dict = dict(env or {})
        self._not_mine: set[int] = set()  # forked here, stopped by their owner (the controller)

    def hand_over(self, pid: int) -> None:
        """A process the template forked that ``kill_forked`` and ``end`` leave alone: the
        controller, which ipyparallel stops (its schedulers and heart monitor with it) and a
        hard restart keeps, whatever becomes of the template."""
        self._not_mine.add(pid)

    def _forked(self) -> list[psutil.Process]:
        try:
            children = self._proc.children() if self._proc is not None else []
        except psutil.Error:
            return []
        return [p for p in children if p.pid not in self._not_mine]

    @property
    def process(self) -> psutil.Process | None:
        return self._proc

    def alive(self) -> bool:
        return self._proc is not None and template_client.alive(self._proc)

    def ensure(self, env: dict, profile_dir: str, log_path: str) -> None:
        """Start the template unless one runs with ``env`` already: a hard restart forks
        from the one the first start warmed. The template starts with the engines'
        environment, so what an interpreter reads as it starts (PYTHONPATH, LD_PRELOAD, an
        --env of the user's) is what a new engine would read; a kernel whose environment
        changed since gets a new template."""
        if self.alive() and self._env == env:
            return
        self.end()
        path = launchers.template_socket(profile_dir)
        try:  # a dead template's socket: a new one must not be taken as ready
            os.remove(path)
        except OSError:
            pass
        self._proc = template_client.start_template(env, profile_dir, path, log_path)
        self._env = env

    def ready(self, profile_dir: str, progress: Progress | None, world_size: int) -> str:
        """The template's socket once it listens; "" (engines start the usual way) if it
        cannot fork: its log's last line is the reason."""
        path = launchers.template_socket(profile_dir)
        if progress:
            progress(0, world_size, "warming the template")
        try:
            template_client.wait_ready(self._proc, path)
            return path
        except template_client.TemplateUnavailable as e:
            log.warning("engines start without the template: %s", e)
            self.end()
            return ""

    def rss(self) -> int | None:
        try:
            return self._proc.memory_info().rss if self.alive() else None
        except psutil.Error:
            return None

    def kill_forked(self) -> None:
        """SIGKILL what the template forked (engines, their nannies, spare engines) in one
        pass, waiting for none: they all end at once, and the template, alive, still reaps
        them and tells each launcher its engine's exit code."""
        for proc in self._forked():
            try:
                proc.kill()  # psutil refuses a pid reused since it listed the child
            except psutil.Error:
                pass

    def end(self) -> None:
        """The template and what it forked that is still there: nannies outlive their
        engines for a while (each tries for up to 3 s to tell the controller), which held a
        stop at 16 ranks for 1.5 s and slowed the controller's. Killed while the template
        still reaps."""
        if self._proc is None:
            return
        end_all(self._forked(), grace=0)
        end_all([self._proc], grace=0)
        self._proc = None
