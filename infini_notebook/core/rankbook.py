"""What the kernel knows of each rank between calls: its RankState row, which ranks are busy
(and since when none is), which failed their last cell, and which are stuck (ignored an
interrupt or a release and still run). :class:`RankBook` is the only writer; its lock makes
it safe for the foreground cell, a background cell's thread and the status poller at once.
Pure: the facts it cannot know (alive? stuck now? telemetry) are passed in."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable

from .state import RankState


class RankBook:
    def __init__(self):
        self._lock = threading.Lock()
        self._rows: list[RankState] = []
        self._busy: set[int] = set()
        self._idle_since = time.monotonic()  # when a rank was last busy (see idle_for)
        self._errored: set[int] = set()
        self._stuck: set[int] = set()

    # ----- the rows ------------------------------------------------------------------------
    def record(self, rows: list[RankState]) -> None:
        """The ranks as they came up (a start, a hard or soft restart)."""
        with self._lock:
            self._rows = list(rows)

    @property
    def rows(self) -> list[RankState]:
        return list(self._rows)

    # ----- busy and idle --------------------------------------------------------------------
    def set_busy(self, ranks: Iterable[int], busy: bool) -> None:
        with self._lock:
            if busy:
                self._busy |= set(ranks)
            else:
                self._busy -= set(ranks)
            self._idle_since = time.monotonic()

    def busy(self) -> set[int]:
        with self._lock:
            return set(self._busy)

    def idle_for(self) -> float:
        """Seconds since a rank was last busy (0 while one is): when background work, such as
        forking spare engines, would slow nobody's cell."""
        with self._lock:
            return 0.0 if self._busy else time.monotonic() - self._idle_since

    # ----- failed and stuck -----------------------------------------------------------------
    def cell_ended(self, ranks: Iterable[int], failed: Iterable[int]) -> None:
        """A cell on ``ranks`` ended; ``failed`` raised in it (shown as errors until a cell
        that works on them)."""
        failed = set(failed)
        with self._lock:
            if failed:
                self._errored |= failed
            else:
                self._errored -= set(ranks)

    def restarted(self, hard: bool) -> None:
        """New process groups: no rank is in error any more; new engines: none is stuck."""
        with self._lock:
            self._errored = set()
            if hard:
                self._stuck = set()

    def add_stuck(self, ranks: Iterable[int]) -> None:
        """Ranks that ignored an interrupt or a release and still run their cell."""
        with self._lock:
            self._stuck |= set(ranks)

    def stuck(self, running: Callable[[], Iterable[int]] | None = None) -> set[int]:
        """The stuck ranks; with ``running`` (the ranks whose engine still has work queued),
        those that finished meanwhile are dropped first. An error asking keeps them all."""
        with self._lock:
            if not self._stuck or running is None:
                return set(self._stuck)
        try:
            still = set(running())
        except Exception:
            return self.stuck()
        with self._lock:
            self._stuck &= still
            return set(self._stuck)

    # ----- the snapshot ---------------------------------------------------------------------
    def snapshot(
        self,
        session_running: bool,
        alive: Callable[[int], bool],
        stuck: set[int],
        telemetry: dict[int, dict],
        exit_code: Callable[[int], int | None],
    ) -> list[RankState]:
        """Each rank's row brought up to date: telemetry, then its state (stopped, dead,
        stuck, busy, error, idle). A dead rank's exit code is looked up once. Returns
        copies: a caller keeping one (``before = session.status()``) compares it with a
        later call, which would otherwise change it too."""
        with self._lock:
            busy, errored, rows = set(self._busy), set(self._errored), list(self._rows)
        for rs in rows:
            for name, value in telemetry.get(rs.rank, {}).items():
                setattr(rs, name, value)
            if not session_running:
                rs.state = "stopped"
            elif not alive(rs.rank):
                if rs.state != "dead":
                    rs.exit_code = exit_code(rs.rank)
                rs.state = "dead"
            elif rs.rank in stuck:
                rs.state = "stuck"
            elif rs.rank in busy:
                rs.state = "busy"
            elif rs.rank in errored:
                rs.state = "error"
            else:
                rs.state = "idle"
        return [dataclasses.replace(rs) for rs in rows]
