"""What the kernel knows of each rank between calls: its RankState row, which ranks are busy
(and since when none is), which failed their last cell (raised, or were released from a wait
on a rank that did), which are stuck (ignored an interrupt or a release and still run), and
whether the session's process groups are whole (a failed rebuild, a timed-out collective:
every command that needs them is refused until a restart). :class:`RankBook` is the only
writer; its lock makes it safe for the foreground cell, a background cell's thread and the
status poller at once. Pure: the facts it cannot know (alive? stuck now? telemetry) are
passed in."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterable

from .ranks import rank_label
from .state import RankState


class RankBook:
    def __init__(self):
        self._lock = threading.Lock()
        self._rows: list[RankState] = []
        self._busy: set[int] = set()
        self._prompting: set[int] = set()  # ranks waiting at an input box for the user
        self._idle_since = time.monotonic()  # when a rank was last busy (see idle_for)
        self._failed: dict[int, str] = {}  # rank -> its one-line error
        self._released: dict[int, str] = {}  # rank -> what it waited for when released
        self._notes: dict[int, str] = {}  # rank -> what its tile says beside 'idle'
        self._stuck: set[int] = set()
        self._broken: tuple[str, str] | None = None  # (why the groups are not whole, the fix)
        self._rebuilt = ""  # the session line after a rebuild that worked
        self._replaced: dict[int, float] = {}  # rank -> when its engine was replaced (time.time)
        self._healed: dict[tuple[str, int], float] = {}  # (name, rank) -> when %dist_heal gave it

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

    def set_prompt(self, rank: int, waiting: bool) -> None:
        """``rank`` waits at an input box for the user (a busy rank, not a hung one)."""
        with self._lock:
            if waiting:
                self._prompting.add(rank)
            else:
                self._prompting.discard(rank)

    def busy(self) -> set[int]:
        with self._lock:
            return set(self._busy)

    def idle_for(self) -> float:
        """Seconds since a rank was last busy (0 while one is): when background work, such as
        forking spare engines, would slow nobody's cell."""
        with self._lock:
            return 0.0 if self._busy else time.monotonic() - self._idle_since

    # ----- failed and stuck -----------------------------------------------------------------
    def cell_ended(
        self,
        ranks: Iterable[int],
        failed: dict[int, str] | Iterable[int],
        released: dict[int, str] | None = None,
    ) -> None:
        """A cell on ``ranks`` ended; ``failed`` raised in it ({rank: one-line error}) and
        ``released`` were freed from a wait on one that did ({rank: what it waited for}).
        They show as failed and released until a cell that works on them; the others of
        ``ranks`` ran it through, and lose what an earlier cell left on their tiles."""
        failed = failed if isinstance(failed, dict) else dict.fromkeys(failed, "")
        released = released or {}
        with self._lock:
            for r in set(ranks) - set(failed) - set(released):
                self._failed.pop(r, None)
                self._released.pop(r, None)
                self._notes.pop(r, None)
            self._failed.update(failed)
            self._released.update(released)
            if not self._failed and not self._released:
                self._rebuilt = ""

    def groups_rebuilt(self) -> None:
        """The automatic rebuild after a failure worked: every rank is idle again, the ones
        that failed or were released with a note saying so, variables kept."""
        with self._lock:
            for r, e in self._failed.items():
                self._notes[r] = f"last cell failed: {e}" if e else "last cell failed"
            for r, why in self._released.items():
                self._notes[r] = f"last cell released ({why})" if why else "last cell released"
            failed = sorted(self._failed)
            self._failed, self._released, self._broken = {}, {}, None
            self._rebuilt = "rebuilt after a failure" + (
                f" on {rank_label(failed)[1:-1]}" if failed else ""
            )

    def groups_broken(self, why: str, fix: str) -> None:
        """The process groups are not whole (a rebuild failed or half applied, a collective
        timed out): ``why``, and the command that makes them whole."""
        with self._lock:
            self._broken = (why, fix)

    def broken(self) -> tuple[str, str] | None:
        with self._lock:
            return self._broken

    def restarted(self, hard: bool) -> None:
        """New process groups: no rank is failed any more; new engines: none is stuck."""
        with self._lock:
            self._failed, self._released, self._notes = {}, {}, {}
            self._broken, self._rebuilt = None, ""
            if hard:
                self._stuck = set()

    def replaced(self, ranks: Iterable[int], now: float | None = None) -> None:
        """New engines for ``ranks`` and new process groups on every rank (the others kept
        their variables): no rank is failed any more; the tiles say "replaced 12 s ago"."""
        now = time.time() if now is None else now
        with self._lock:
            self._failed, self._released, self._notes = {}, {}, {}
            self._broken, self._rebuilt = None, ""
            self._stuck -= set(ranks)
            self._replaced.update(dict.fromkeys(ranks, now))

    def replaced_at(self) -> dict[int, float]:
        """Each replaced rank's last replacement (time.time), for the tiles and %dist_heal."""
        with self._lock:
            return dict(self._replaced)

    def healed(self, name: str, ranks: Iterable[int], now: float | None = None) -> None:
        """%dist_heal gave ``name`` to ``ranks``: their copy is no longer stale."""
        now = time.time() if now is None else now
        with self._lock:
            self._healed.update({(name, r): now for r in ranks})

    def stale(self, name: str) -> set[int]:
        """The ranks replaced since ``name`` was last healed into them (or never healed):
        what they hold under it was made after the replacement, not a replica's."""
        with self._lock:
            return {r for r, t in self._replaced.items() if self._healed.get((name, r), 0) < t}

    def session_line(self, died: Iterable[int] = (), stuck: Iterable[int] = ()) -> str:
        """The session's state in a line: 'ready', 'rebuilt after a failure on rank 1,
        variables kept', or 'needs %dist_restart --ranks 2 (or --hard): rank 2 died'."""
        died, stuck = sorted(died), sorted(stuck)
        with self._lock:
            broken, rebuilt = self._broken, self._rebuilt
        if died:
            flag = ",".join(map(str, died))
            return f"needs %dist_restart --ranks {flag} (or --hard): {rank_label(died)[1:-1]} died"
        if broken:
            return f"needs {broken[1]}: {broken[0]}"
        if stuck:
            return (
                f"{rank_label(stuck)[1:-1]} stuck in native code: wait for the collective "
                "timeout, or %dist_restart --hard"
            )
        return f"{rebuilt}, variables kept" if rebuilt else "ready"

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
        stuck, at a prompt, busy, failed, released, idle). A dead rank's exit code is
        looked up once. Returns copies: a caller keeping one (``before =
        session.status()``) compares it with a later call, which would otherwise change it
        too."""
        with self._lock:
            busy, rows, prompting = set(self._busy), list(self._rows), set(self._prompting)
            failed, released, notes = dict(self._failed), dict(self._released), dict(self._notes)
            replaced = dict(self._replaced)
        now = time.time()
        for rs in rows:
            for name, value in telemetry.get(rs.rank, {}).items():
                setattr(rs, name, value)
            rs.note = notes.get(rs.rank, "")
            if not rs.note and rs.rank in replaced:
                rs.note = f"replaced {ago(now - replaced[rs.rank])}"
            if not session_running:
                rs.state = "stopped"
            elif not alive(rs.rank):
                if rs.state != "died":
                    rs.exit_code = exit_code(rs.rank)
                rs.state = "died"
            elif rs.rank in stuck:
                rs.state = "stuck"
            elif rs.rank in prompting:
                rs.state = "prompt"
            elif rs.rank in busy:
                rs.state = "busy"
            elif rs.rank in failed:
                rs.state, rs.note = "failed", failed[rs.rank]
            elif rs.rank in released:
                rs.state, rs.note = "released", released[rs.rank]
            else:
                rs.state = "idle"
        return [dataclasses.replace(rs) for rs in rows]


def ago(seconds: float) -> str:
    """'12 s ago', '3 min ago', '2 h ago'."""
    if seconds < 90:
        return f"{max(0, round(seconds))} s ago"
    if seconds < 90 * 60:
        return f"{round(seconds / 60)} min ago"
    return f"{round(seconds / 3600)} h ago"
