"""Whom a wait is for: where a delay starts, passed along the ranks that were themselves
waiting (the critical path through a cell's collectives and messages across ranks). Pure.

A rank that waits in an op, from its arrival until the op's last member arrives, waits for
that last member. If the last member spent part of that time waiting itself (in another op,
for a third rank), that part of the wait is the third rank's doing, passed on through the
last member; and so on. What is left is the last member's own time (compute, Python, a
sleep): the delay starts there. So in a pipeline 0 -> 1 -> 2 -> 3 with rank 0 late, rank 3
waits for rank 0 through ranks 2 and 1, not for rank 2.

Times are in one clock (the kernel's, after timeline.align); a chain is the tuple of ranks
from the one waited for directly to the one where the delay starts.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from . import intervals


@dataclass(frozen=True)
class Wait:
    """``rank`` waited from ``start`` to ``end`` for ``last``, the op's last arrival."""

    rank: int
    start: float
    end: float
    last: int


@dataclass(frozen=True)
class Member:
    """A rank's part in one op: when it arrived (``start``) and when its part ended."""

    rank: int
    start: float
    end: float


class Waits:
    """Every rank's waits in the ops seen on every member, as the profile's rows count them:
    each rank's made disjoint (a rank parked in two ops at once waits once), less the time
    it computed meanwhile (``busy``: an async op waits while the rank works), inside its
    ``window`` (its cell)."""

    def __init__(
        self,
        ops: list[list[Member]],
        busy: dict[int, list[tuple[float, float]]] | None = None,
        window: dict[int, tuple[float, float]] | None = None,
    ):
        found: dict[int, list[Wait]] = {}
        for members in ops:
            last = max(members, key=lambda m: (m.start, m.rank))
            for m in members:
                end = min(m.end, last.start)
                if m.rank != last.rank and end > m.start:
                    found.setdefault(m.rank, []).append(Wait(m.rank, m.start, end, last.rank))
        busy, window = busy or {}, window or {}
        self.by_rank = {
            r: _less(_disjoint(ws), busy.get(r, []), window.get(r)) for r, ws in found.items()
        }
        self._starts = {r: [w.start for w in ws] for r, ws in self.by_rank.items()}

    def chains(self, rank: int) -> dict[tuple[int, ...], float]:
        """Whom ``rank`` waited for, by chain: (waited for directly, ..., where the delay
        started) -> time."""
        out: dict[tuple[int, ...], float] = {}
        for w in self.by_rank.get(rank, []):
            _add_all(out, self._blame(w.last, w.start, w.end, (rank,)))
        return out

    def _blame(self, rank: int, lo: float, hi: float, seen: tuple[int, ...]) -> dict:
        """[lo, hi) of ``rank`` being late: its own waits in it passed on, the rest its own."""
        out: dict[tuple[int, ...], float] = {}
        cursor = lo
        ws = self.by_rank.get(rank, [])
        first = max(0, bisect.bisect_right(self._starts.get(rank, []), lo) - 1)
        for w in ws[first:]:
            if w.start >= hi:
                break
            a, b = max(w.start, cursor), min(w.end, hi)
            if b <= a:
                continue
            _add(out, (rank,), a - cursor)
            if w.last in seen or w.last == rank:  # a cycle (ops that overlap): stop here
                _add(out, (rank,), b - a)
            else:
                for chain, t in self._blame(w.last, a, b, seen + (rank,)).items():
                    _add(out, (rank, *chain), t)
            cursor = b
        _add(out, (rank,), hi - cursor)
        return out


def _disjoint(ws: list[Wait]) -> list[Wait]:
    """A rank's waits sorted and cut so that none overlaps an earlier one."""
    out: list[Wait] = []
    cursor = float("-inf")
    for w in sorted(ws, key=lambda w: (w.start, w.end)):
        start = max(w.start, cursor)
        if w.end > start:
            out.append(Wait(w.rank, start, w.end, w.last))
            cursor = w.end
    return out


def _less(ws: list[Wait], busy, window) -> list[Wait]:
    """Disjoint waits less the ``busy`` spans, inside ``window``."""
    out = []
    for w in ws:
        spans = intervals.subtract([(w.start, w.end)], busy)
        if window is not None:
            spans = intervals.clip(spans, *window)
        out += [Wait(w.rank, a, b, w.last) for a, b in spans]
    return out


def _add(out: dict, chain: tuple[int, ...], t: float) -> None:
    if t > 0:
        out[chain] = out.get(chain, 0.0) + t


def _add_all(out: dict, more: dict) -> None:
    for chain, t in more.items():
        _add(out, chain, t)


def by_root(chains: dict[tuple[int, ...], float]) -> dict[int, float]:
    """Time per rank where the delay started."""
    out: dict[int, float] = {}
    for chain, t in chains.items():
        out[chain[-1]] = out.get(chain[-1], 0.0) + t
    return out


def main_chain(chains: dict[tuple[int, ...], float], root: int) -> tuple[int, ...]:
    """The chain that carried most of the wait for ``root``."""
    return max((c for c in chains if c[-1] == root), key=lambda c: (chains[c], -len(c)))


def through(chain: tuple[int, ...]) -> str:
    """'' for a direct wait; 'through ranks 1 and 2' (the ranks between, from where the
    delay started outward) otherwise."""
    between = list(reversed(chain[:-1]))
    if not between:
        return ""
    if len(between) == 1:
        return f"through rank {between[0]}"
    return f"through ranks {', '.join(map(str, between[:-1]))} and {between[-1]}"
