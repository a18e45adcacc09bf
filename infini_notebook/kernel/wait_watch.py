"""Kernel side, while a cell runs: which ranks left it (raised, finished, died) and what the
running ones wait in. A wait that can never finish (its group holds a rank that left) is
released; a long wait with no rank gone is shown in place with where each rank waits.
The pure part (who waits for whom, the sentences) is ``waits.py``.
"""

from __future__ import annotations

import logging
import time

from ..core import waits
from ..core.output import left_debugger, one_line, remote_traceback
from ..core.ranks import rank_label
from . import supervision

log = logging.getLogger("infini_notebook")

GONE_POLL_S = 0.25  # how often running ranks are asked while a rank has left the cell
HANG_AFTER_S = 2.0  # a rank in the same wait this long, nobody gone: show where ranks wait
HANG_POLL_S = 1.0
RELEASE_GRACE_S = 3.0  # a released rank still waiting after this is given up as stuck
RELEASE_GIVE_UP_S = 30.0  # ... and one out of its wait but still in its cell, after this
LIVE_HOLD_S = 0.2  # a failure shown live once the others have not followed it this long
ASK_WAIT_S = 1.0  # answers come from a thread beside the cell: quick, unless the host is busy


class WaitWatch:
    """One running cell's view of its ranks' waits. ``follow`` feeds it the ranks that
    leave (``left``) and calls ``tick`` in its loop."""

    def __init__(self, s, cell, cell_name: str = ""):
        self.s, self.cell, self.cell_name = s, cell, cell_name
        self.gone: dict[int, str] = {}  # rank -> failed / finished / died
        self.released: dict[int, list[int]] = {}  # rank -> the gone ranks it waited for
        self.released_waits: dict[int, dict] = {}
        self.released_at: float | None = None
        self.ended: set[int] = set()  # gone ranks whose process groups were ended
        self.let_go: set[int] = set()  # waiting ranks told to let go (gloo: close; NCCL: abort)
        self.shown_live: set[int] = set()  # ranks whose traceback was printed as it came
        self.unshown: dict[int, float] = {}  # failed ranks -> when, until shown live
        self.seen: dict[int, tuple] = {}  # rank -> (its wait, first seen) for confirmation
        self.found: dict[int, dict | None] = {}  # the latest answers: rank -> its wait
        self.since: dict[int, tuple] = {}  # rank -> (its wait, first seen) for a hang
        self.last_wait: dict[int, tuple] = {}  # rank -> (its last wait, when) for a hang
        self.started = time.monotonic()
        self.next_ask = self.started + HANG_POLL_S
        self.hang_shown = ""
        self._handle = None

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
            if failed and running:
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
                self.cell.note(r, f"{rank_label([r])}\n{remote_traceback(reply).rstrip()}\n")
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
        text = f"waiting {waited:.0f} s: {waits.verdict(found, self.cell_name)}"
        self.hang_shown = text
        status = getattr(self.cell.printer, "status", None)  # optional for a user's printer
        if status is not None:
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
            self.released, self.released_waits, self.gone, self.cell_name, late
        )


def end_groups(s, ending: list[int], blocked: list[int], gone: dict[int, str]) -> None:
    """Release waits on the ranks ``ending`` (they left the cell, alive): they end their
    process groups and close their connections to every other rank (gloo: a wait on such a
    connection raises 'Connection closed by peer'; a dead rank's closed with it). Only
    groups that hold a rank that left are touched: a connection joins two ranks' processes
    and serves only groups holding both.

    The ``blocked`` ranks (waiting in vain) are leaving too. On gloo they shut down their
    connections to each other and to the ranks that left, from their answering thread: a
    ring or tree collective waits on neighbours only, so releasing only the ranks next to
    the one that left took a round per hop (8 ranks: four rounds, 1.3-4 s). On NCCL they
    abort their communicators: only an abort ends a wait in NCCL."""
    import json

    from ..engine import bootstrap

    nccl = "nccl" in s.plan.backend
    if blocked:  # first, before anything of theirs is cut: see rank_services.release
        s.rendezvous.ask(blocked, f"release {s.attempt}", ASK_WAIT_S)
    links: dict[int, list] = {}
    if ending or (blocked and not nccl):
        alive = [r for r in range(s.world_size) if gone.get(r) != "died" and r not in ending]
        answers = s.rendezvous.ask(alive, "links", ASK_WAIT_S)
        links = {r: json.loads(text) for r, text in answers.items()}
    if ending:
        peer_links = [link for own in links.values() for link in own]
        with s.engines.client.lock:
            ar = s.engines.view(ending).apply_async(bootstrap.release_groups, peer_links)
    if blocked and nccl:
        s.rendezvous.ask(blocked, f"abort {s.attempt}", ASK_WAIT_S)
    elif blocked:
        leaving = set(blocked) | {r for r, why in gone.items() if why != "died"}
        close = {r: waits.links_between(links, r, leaving) for r in blocked}
        questions = {r: f"close {s.attempt} {json.dumps(own)}" for r, own in close.items() if own}
        if questions:
            s.rendezvous.ask(sorted(questions), questions, ASK_WAIT_S)
    if ending:
        try:
            log.debug("released %s (%s): %s", ending, blocked, ar.get(timeout=10))
        except Exception as e:
            log.warning("ending the process groups of %s: %s", ending, e)
        s.engines.client.forget(ar.msg_ids)


# How a wait ends when its peer is gone: gloo's closed or reset connection, NCCL's abort.
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "aborted")


def peer_lost(error: str) -> bool:
    """An error that says a peer went away (a consequence of another rank leaving)."""
    text = error.lower()
    return any(words in text for words in _PEER_LOST)


def _engine_error(reply) -> bool:
    return getattr(reply, "ename", type(reply).__name__) == "EngineError"
