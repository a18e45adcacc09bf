"""Watching a running cell, from its send until every rank left it: its output shown as it
arrives (``Cell``), the ranks' questions for stdin answered (``Prompts``), ranks that
finish, raise or die (a failure shown at once), what the running ones wait in, waits that
can never finish released (their group holds a rank that left: ``release.py`` ends them),
a long wait with no rank gone shown in place with where each rank waits, released ranks
still stuck given up with their stacks, the Stop button (the ranks that stop leave as ranks
that raised, so the ones waiting for them are released and the groups rebuilt), and the
output that trails the replies. It asks ``supervision.py`` (liveness, waits, stacks,
signals), which never calls back; ``execution.py`` sends the cell before and reads the
result after. The pure part
(who waits for whom, the sentences) is ``core/waits.py``.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time

from ..core import waits
from ..core.errors import DistCellError, DistInterrupted
from ..core.output import left_debugger, main_thread_stack, one_line, remote_traceback
from ..core.ranks import rank_label
from ..launch.client import CONTROLLER_GONE
from . import debug_proxy, recovery, supervision
from .prompts import Prompts
from .release import ASK_WAIT_S, end_groups

log = logging.getLogger("infini_notebook")

INTERRUPT_GRACE_S = 3.0
COLLAPSE_HOLD_S = 2.0
# Jupyter's restart and shutdown interrupt the kernel before they end it: a kept session's
# Stop waits this long for the shutdown request that tells the two apart.
SHUTDOWN_GRACE_S = 1.0
DEAD_CHECK_S = 0.5  # how often a running cell looks for ranks that died
GONE_POLL_S = 0.25  # how often running ranks are asked while a rank has left the cell
HANG_AFTER_S = 2.0  # a rank in the same wait this long, nobody gone: show where ranks wait
HANG_POLL_S = 1.0
RELEASE_GRACE_S = 3.0  # a released rank still waiting after this is given up as stuck
RELEASE_GIVE_UP_S = 30.0  # ... and one out of its wait but still in its cell, after this
LIVE_HOLD_S = 0.2  # a failure shown live once the others have not followed it this long


@contextlib.contextmanager
def stop_pressed_again_ignored():
    """Stop pressed again while the first press is carried out (ranks signalled, their
    waits released, the groups rebuilt) asks for the same: its KeyboardInterrupt cut that
    short, a library traceback shown and the groups left half rebuilt (the next cell
    failed with TaskAborted). SIGINT reaches only the main thread's handler."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


class CellWatch:
    """One running cell, followed until every rank left it (``follow``), then its trailing
    output (``last_output``). What it found stays for the cell's result and error: which
    ranks left and why (``gone``), which were released and for whom (``released``), whose
    traceback was shown live (``shown_live``)."""

    def __init__(self, s, cell, cell_name: str = ""):
        self.s, self.cell, self.cell_name = s, cell, cell_name
        self.gone: dict[int, str] = {}  # rank -> failed / finished / died
        self.released: dict[int, list[int]] = {}  # rank -> the gone ranks it waited for
        self.released_waits: dict[int, dict] = {}
        self.released_at: float | None = None
        self.ended: set[int] = set()  # gone ranks whose process groups were ended
        self.let_go: set[int] = set()  # waiting ranks told to let go (gloo: close; NCCL: abort)
        self.shown_live: set[int] = set()  # ranks whose traceback was printed as it came
        self.interrupting = False  # the Stop button was pressed
        self.interrupted: set[int] = set()  # the ranks still in the cell when it was
        self.unshown: dict[int, float] = {}  # failed ranks -> when, until shown live
        self.seen: dict[int, tuple] = {}  # rank -> (its wait, first seen) for confirmation
        self.found: dict[int, dict | None] = {}  # the latest answers: rank -> its wait
        self.since: dict[int, tuple] = {}  # rank -> (its wait, first seen) for a hang
        self.last_wait: dict[int, tuple] = {}  # rank -> (its last wait, when) for a hang
        self.started = time.monotonic()
        self.next_ask = self.started + HANG_POLL_S
        self.hang_where = ""  # where the ranks wait, as the wait line last said it
        self._handle = None

    # ----- following the cell -------------------------------------------------------------
    def follow(self) -> None:
        """Show output as it arrives and each rank idle as soon as it is; answer the ranks'
        prompts; notice ranks that fail or die while others run, and release the waits that
        can never finish. The Stop button raises DistInterrupted."""
        s, cell = self.s, self.cell
        s.rendezvous.take_notices()  # an interrupted cell's: said there, as they came
        prompts = Prompts(s, cell, on_answer=self.human_answered)
        s.book.set_busy(cell.targets, True)
        stuck = None
        with contextlib.ExitStack() as stopping:
            try:
                self._follow(prompts)
            except KeyboardInterrupt:
                if s.keeper.keeps and kernel_shuts_down(SHUTDOWN_GRACE_S):
                    raise DistInterrupted(
                        f"The kernel shuts down: the cell goes on in kept session "
                        f"{s.keeper.name!r} (%dist_attach {s.keeper.name} from the next "
                        "kernel).",
                        ranks=[],
                    ) from None
                stopping.enter_context(stop_pressed_again_ignored())
                stuck = self.interrupt()
                cell.wait_for_trailing_output()  # else a late idle re-creates a purged record
            finally:
                s.book.set_busy(cell.targets, False)
                cell.detach()
                s.rendezvous.drop_unread_answers()
            if stuck is not None:  # the ranks are out of the cell (but ``stuck``): rebuild
                raise DistInterrupted(self._after_interrupt(stuck), ranks=stuck) from None

    def _follow(self, prompts: Prompts) -> None:
        """The loop: until no rank of the cell is left running."""
        s, cell = self.s, self.cell
        t0 = last_check = time.monotonic()
        running = set(cell.targets)
        while running:
            wake = min(self.next_wake(), prompts.next_poll)
            pause = min(DEAD_CHECK_S, max(0.01, wake - time.monotonic()))
            if cell.changed.wait(pause):
                cell.changed.clear()  # before reading: a later message wakes the next wait
            finished = cell.finished_among(running)
            # A lost connection is a consequence: look for a dead peer first, to name it.
            if running - finished and (
                time.monotonic() - last_check > DEAD_CHECK_S or self.lost_peer(finished)
            ):
                last_check = time.monotonic()
                if not s.engines.client.controller_running():  # no reply can come any more
                    raise DistCellError(CONTROLLER_GONE, ranks=sorted(running))
                dead = set(supervision.dead_ranks(s, sorted(running - finished)))
                if dead:  # their peers' waits are released below; the others finish
                    running -= dead
                    s.book.set_busy(dead, False)
                    self.left(dead, running - finished, died=True)
            if finished:
                running -= finished
                s.book.set_busy(finished, False)
                self.left(finished, running)
            # --collapse holds output back a little, so that lines the ranks print at about
            # the same time arrive together and can be merged.
            if not cell.labeler.collapse or time.monotonic() - t0 > COLLAPSE_HOLD_S:
                cell.show(final=False)
            if running:
                prompts.serve()  # parks here while the user types: nothing is released
            stuck = self.tick(running)
            if stuck:  # released, yet still waiting: native code that ignores the release
                running -= stuck
                self._give_up(sorted(stuck))

    def last_output(self) -> None:
        """Once every rank left: the output that trails the replies (waited for while a rank
        owing it is alive), shown, then the whole output again in rank order."""
        self.cell.wait_for_trailing_output(supervision.liveness(self.s))
        self._hang_is_over()
        self.cell.show(final=True)
        self.cell.render_final()
        for said in self.s.rendezvous.take_notices():  # tampering seen in the store: kept
            self.cell.printer.err(f"infini_notebook: {said}\n")

    def _give_up(self, stuck: list[int]) -> None:
        """End the cell without ranks that could not be released: show where they are; the
        next cell on them is refused (execution.refuse_stuck) until they finish."""
        self.s.book.add_stuck(stuck)
        for r, text in self._stacks(stuck).items():
            self.cell.note(r, text)

    def interrupt(self) -> list[int]:
        """Stop button: SIGINT every running rank. A rank that stops leaves the cell as one
        that raised, so the ranks waiting for it in a collective (native code: SIGINT
        cannot end that wait) are released as for a failure, their groups rebuilt after
        (``_after_interrupt``). Returns the ranks that neither stopped nor were released
        (native code that ignores both): stuck until the collective timeout, said in one
        line; their stacks are %dist_stacks' to show."""
        s, cell = self.s, self.cell
        running = {r for r in cell.targets if not cell.done(r)}
        self.interrupting, self.interrupted = True, set(running)
        supervision.send_signal(s, signal.SIGINT, sorted(running))
        deadline = time.monotonic() + INTERRUPT_GRACE_S
        while running and time.monotonic() < deadline:
            if cell.changed.wait(0.05):
                cell.changed.clear()
            finished = {r for r in running if cell.done(r)}
            if finished:
                running -= finished
                self.left(finished, running)
            if running:
                self.tick(running)  # asks where they wait; releases waits on ranks gone
        stuck = sorted(running)
        if stuck:
            s.book.add_stuck(stuck)  # added to: ranks stuck in an earlier cell may still be
        return stuck

    def _after_interrupt(self, stuck: list[int]) -> str:
        """The interrupted cell's one line: who stopped, who was released from a wait on
        them (their groups rebuilt now, variables kept), who is stuck and what to do."""
        s, targets = self.s, self.cell.targets
        # a rank that had finished before Stop was not stopped: it is not named
        stopped = [
            r for r in targets if r in self.interrupted and r not in {*self.released, *stuck}
        ]
        parts = ["cell interrupted" + (f"; {rank_label(stopped)[1:-1]} stopped" if stopped else "")]
        if self.released:
            parts.append(self.released_text())
        if stuck:
            parts.append(
                f"{rank_label(stuck)[1:-1]} ignored SIGINT for {INTERRUPT_GRACE_S:.0f} s: stuck "
                f"in native code (%dist_stacks shows where). They stay busy until the "
                f"{s.plan.timeout:.0f} s collective timeout fires; then "
                f"{recovery.restart_advice(s, after_timeout=True)} %dist_restart --hard "
                "restarts the engines now"
            )
            return "; ".join(parts) + "."
        if not self.released:
            return "; ".join(parts) + ". The session is ready."
        s.book.cell_ended(
            targets,
            failed={r: "interrupted" for r in stopped if self.gone.get(r) == "failed"},
            released={
                r: f"was waiting for {rank_label(n)[1:-1]}" for r, n in self.waited_for().items()
            },
        )
        return "; ".join(parts) + ". " + recovery.rebuild_after_release(s)

    def _stacks(self, ranks: list[int]) -> dict[int, str]:
        """Each rank's main thread, labeled, to show."""
        stacks = supervision.stacks(self.s, ranks)
        return {r: f"{rank_label([r])} stack:\n{main_thread_stack(stacks[r])}\n" for r in ranks}

    # ----- ranks leaving ------------------------------------------------------------------
    def left(self, ranks, running: set[int], died: bool = False) -> None:
        """``ranks`` left the cell while ``running`` still run it. A failure is shown at
        once (the root cause, before the ranks waiting for it are released)."""
        # Within one batch, errors of their own before those that say a peer went away
        for r in sorted(ranks, key=lambda r: (not died and self._lost_peer(r), r)):
            if died:
                self.gone[r] = "died"
                continue
            reply = self.cell.futures[r].result()
            if _engine_error(reply):  # ipyparallel's answer for a rank that went away
                self.gone[r] = "died"
                continue
            failed = isinstance(reply, BaseException)
            if r in self.released or (failed and self._consequence(reply)):
                self.gone[r] = "released"  # a consequence, not a cause
                continue
            self.gone[r] = "failed" if failed else "finished"
            if failed and running and not self.interrupting:  # a KeyboardInterrupt: no news
                self.unshown[r] = time.monotonic()
        if running:  # a failure: ask at once; ranks finishing a cell: a moment later,
            # as the others usually follow within milliseconds (asking 16 ranks at once
            # cost an empty cell 9 ms)
            failed = any(self.gone.get(r) in ("failed", "died") for r in ranks)
            soon = time.monotonic() + (0.0 if failed else GONE_POLL_S)
            self.next_ask = min(self.next_ask, soon)

    def _lost_peer(self, rank: int) -> bool:
        reply = self.cell.futures[rank].result()
        return isinstance(reply, BaseException) and peer_lost(one_line(reply))

    def _consequence(self, reply) -> bool:
        """A failure that follows another rank's leaving: its error says a peer went away,
        and a rank failed or died before it. The first rank to fail is a cause whatever its
        words say (a data loader's own 'connection reset by peer', say)."""
        causes = any(why in ("failed", "died") for why in self.gone.values())
        return causes and peer_lost(one_line(reply))

    def next_wake(self) -> float:
        """When tick has work next (monotonic time)."""
        return min([self.next_ask] + [t + LIVE_HOLD_S for t in self.unshown.values()])

    def lost_peer(self, ranks) -> bool:
        """Did one of ``ranks`` (just finished) fail because a peer went away?"""
        for r in ranks:
            reply = self.cell.futures[r].result()
            if isinstance(reply, BaseException) and peer_lost(one_line(reply)):
                return True
        return False

    # ----- while ranks run ----------------------------------------------------------------
    def tick(self, running: set[int]) -> set[int]:
        """Ask the running ranks where they wait when it is time; release hopeless waits.
        Returns released ranks that are still running past the grace: stuck for good."""
        now = time.monotonic()
        self._show_failures(running, now)
        if running and now >= self.next_ask:
            self.next_ask = now + (GONE_POLL_S if self.gone else HANG_POLL_S)
            try:  # never the end of a cell: without this watch it runs as it always did
                found = supervision.waits(self.s, sorted(running), ASK_WAIT_S)
                self.found = found
                if self.gone:
                    self._release(found, now)
                    if any(found.values()) and debug_proxy.paused_now():
                        # the others finished; who waits for the paused rank says so
                        self._show_hang(found, now)
                elif any(found.values()):  # a rank waits: say where (not "all computing")
                    self._show_hang(found, now)
            except Exception as e:
                log.warning("watching the ranks' waits: %s", e)
        if self.released_at is not None and now - self.released_at > RELEASE_GRACE_S:
            return self._stuck(running & set(self.released), now - self.released_at)
        return set()

    def _stuck(self, released: set[int], since: float) -> set[int]:
        """Released ranks given up as stuck: those still in a wait, or not answering (native
        code holds their interpreter). One out of its wait is ending its cell: its error's
        traceback alone can take seconds of CPU on a loaded host (IPython formats it), and
        giving it up then refused the rebuild that follows; it gets RELEASE_GIVE_UP_S."""
        if since > RELEASE_GIVE_UP_S:
            return released
        return {r for r in released if self.found.get(r, "no answer")}

    def _show_failures(self, running: set[int], now: float) -> None:
        """A failure's traceback at once, while others still run. Ranks that fail together
        (within LIVE_HOLD_S) are left to the final report, which groups identical ones."""
        due = [r for r, t in self.unshown.items() if now - t >= LIVE_HOLD_S]
        if not running or not due:
            return
        for r in sorted(due):
            reply = self.cell.futures[r].result()
            if not left_debugger(reply):  # its one line in the cell's error says it all
                self.cell.failure_note(r, remote_traceback(reply))
            self.shown_live.add(r)
            del self.unshown[r]

    def _release(self, found: dict, now: float) -> None:
        hopeless = waits.hopeless(found, self.gone)
        ready = {}
        for r, needed in hopeless.items():
            key = repr(sorted(found[r].items()))
            first = self.seen.setdefault(r, (key, now))
            if first[0] != key:
                self.seen[r] = first = (key, now)
            # A rank that finished may have sent what this one still receives: confirm
            # the wait once before ending it. Raised and dead ranks never come back.
            if any(self.gone[g] != "finished" for g in needed) or now - first[1] >= GONE_POLL_S:
                ready[r] = needed
        if not ready:
            return
        causes = {g for g, why in self.gone.items() if why != "released"}
        for r, needed in ready.items():  # named by the ranks that caused it, if among them
            self.released[r] = [g for g in needed if g in causes] or needed
            self.released_waits[r] = found[r]
        # Each rank's groups are ended once; a wait may need several (a ring waits on a
        # neighbour that leaves only when released itself), so the grace starts anew.
        new = {g for n in ready.values() for g in n if self.gone[g] != "died"} - self.ended
        blocked = set(ready) - self.let_go
        if new or blocked:
            self.released_at = now
            self.ended |= new
            self.let_go |= blocked
            end_groups(self.s, sorted(new), sorted(blocked), self.gone)

    def _show_hang(self, found: dict, now: float) -> None:
        """Shown once a rank has been in the same wait (call, group, number) HANG_AFTER_S:
        a cell that moves from collective to collective, however slowly, shows nothing. A
        rank just out of its wait keeps it in the line for HANG_AFTER_S: one whose wait
        timed out is still formatting its error (seconds on a loaded host) when the line is
        last updated, and 'computing' would be its last word."""
        found = dict(found)
        for r, wait in list(found.items()):
            if wait:
                self.last_wait[r] = (wait, now)
            elif r in self.last_wait and now - self.last_wait[r][1] < HANG_AFTER_S:
                found[r] = self.last_wait[r][0]
        for r, wait in found.items():
            key = repr(sorted(wait.items())) if wait else None
            if self.since.get(r, (None,))[0] != key:
                self.since[r] = (key, now)
        stale = [r for r, w in found.items() if w and now - self.since[r][1] >= HANG_AFTER_S]
        if not stale and self._handle is None:
            return
        waited = now - self.started
        paused = debug_proxy.paused_now()  # the others wait for them: not a hang
        self.hang_where = waits.verdict(found, self.cell_name, paused)
        text = f"waiting {waited:.0f} s: {self.hang_where}"
        status = getattr(self.cell.printer, "status", None)  # optional for a user's printer
        if status is not None:
            self._handle = status(text, self._handle)

    def _hang_is_over(self) -> None:
        """A wait line shown while every rank then finished (a slow rank, a rank paused in
        the debugger) says it in the past: 'waiting 21 s' above the ranks' output read as
        a cell still stuck. Kept as it was where a rank failed: it says where they waited."""
        status = getattr(self.cell.printer, "status", None)
        if self._handle is None or status is None or not self.hang_where:
            return
        if any(self.gone.get(r) != "finished" for r in self.cell.targets):
            return
        waited = time.monotonic() - self.started
        text = f"waited {waited:.0f} s, then every rank went on: {self.hang_where}"
        self._handle = status(text, self._handle)

    def human_answered(self) -> None:
        """A prompt was answered (kernel/prompts.py): the ranks' time spent waiting for a
        human is no hang, so a wait counts from now."""
        self.since = {}

    # ----- the end --------------------------------------------------------------------------
    def released_text(self) -> str:
        if not self.released:
            return ""
        # A rank slower to reach the wait than the release meets closed connections: it
        # is not among the ranks seen waiting, but must not go unmentioned.
        late = [r for r, why in self.gone.items() if why == "released" and r not in self.released]
        return waits.released_text(
            self.waited_for(), self.released_waits, self.gone, self.cell_name, late
        )

    def waited_for(self) -> dict[int, list[int]]:
        """Each released rank -> the ranks it waited for, named once the cell is over: at
        the release only the first of them had left (Stop ends ranks 1-3 a few ms apart;
        rank 0, waiting for all three, was released when rank 1 left), and which one was
        first is the scheduler's choice, not news."""
        causes = {g for g, why in self.gone.items() if why != "released"}
        out = {}
        for r, first in self.released.items():
            needed = waits.waited_for(self.released_waits[r] or {}, self.gone)
            out[r] = [g for g in needed if g in causes] or first
        return out


# How a wait ends when its peer is gone: gloo's closed or reset connection, NCCL's abort.
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "aborted")


def peer_lost(error: str) -> bool:
    """An error that says a peer went away (a consequence of another rank leaving)."""
    text = error.lower()
    return any(words in text for words in _PEER_LOST)


def _engine_error(reply) -> bool:
    return getattr(reply, "ename", type(reply).__name__) == "EngineError"


def kernel_shuts_down(grace: float) -> bool:
    """Whether the interrupt that came was the first step of Jupyter's restart or shutdown
    (jupyter_client interrupts the kernel, then asks it to shut down, or kills it, at once):
    True once the shutdown request arrives within ``grace`` seconds (IPython's ``exit_now``,
    set on the kernel's control thread). A second Stop within it is a Stop."""
    try:
        from IPython import get_ipython

        shell = get_ipython()
        deadline = time.monotonic() + grace
        while shell is not None and time.monotonic() < deadline:
            if getattr(shell, "exit_now", False):
                return True
            time.sleep(0.02)
        return bool(getattr(shell, "exit_now", False))
    except (ImportError, KeyboardInterrupt):
        return False
