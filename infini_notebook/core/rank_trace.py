"""What one rank's profiler trace yields for ``%%dist_profile``. Pure: the rank's events,
marks, Flight Recorder entries and p2p notes in; a small ``Summary`` out (its window, its
trace clock's offset, its collectives and p2p ops, its compute spans and self times). It
runs on the rank, which summarizes its own trace (engine/profiling.py), so the kernel never
walks the events; the cross-rank figures are timeline.py's.

Window. A rank's figures cover its cell: from the mark the rank records as the cell's code
starts to the one it records once the cell has ended (its device work done), not the
profiler's start and stop, which the kernel's round trips put at different moments on
different ranks.

Clock. The rank's trace has its own time base; marks the rank records while reading its
wall clock map it to the rank's wall clock (``trace_offset_us``). ``RankClock`` is the
kernel's sample of that wall clock through the store (``best_sample``); timeline.py aligns
the ranks on the kernel's clock.

Compute, per rank over its window: a GPU rank's kernels and copies, a CPU rank's cell
thread's ops, with each op's self time (its time less its children's).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from . import gloo_ops, intervals, nccl_ops
from . import kineto as k
from .comm_ops import CommOp
from .kineto import CELL_END, CELL_START, START_MARK, STOP_MARK


@dataclass
class RankClock:
    """Offset of a rank's wall clock from the kernel's (ns, rank minus kernel) and the
    round trip of the sample it comes from."""

    offset_ns: float = 0.0
    rtt_ns: float = 0.0


def best_sample(samples: list[tuple[int, int, int]]) -> RankClock:
    """From (kernel before, rank, kernel after) samples, the one with the tightest round
    trip: the rank read its clock somewhere in between."""
    before, rank, after = min(samples, key=lambda s: s[2] - s[0])
    return RankClock(offset_ns=rank - (before + after) / 2, rtt_ns=after - before)


@dataclass
class Summary:
    """What the figures need of one rank's trace, computed where the trace is (on the rank,
    in parallel with the others: engine/profiling.py) so that the kernel never walks the
    events: small, plain data on the rank's trace clock (µs)."""

    trace_off_us: float = 0.0  # trace clock -> the rank's wall clock (marks)
    window: tuple[float, float] = (0.0, 0.0)  # the cell (see ``window``)
    ops: list[CommOp] = field(default_factory=list)  # collectives and p2p ops in the window
    unmeasured: int = 0  # NCCL ops with no GPU span
    compute: list = field(default_factory=list)  # union of compute spans, cut to the window
    per_name: dict[str, float] = field(default_factory=dict)  # self time per op name (µs)
    first_ts: float | None = None  # the earliest event the merged trace keeps
    thread_names: list[dict] = field(default_factory=list)  # trace_merge's metadata
    flows: int = 0  # distinct flow ids (the merged trace numbers each rank's after these)


@dataclass
class RankTrace:
    rank: int
    events: list[dict]  # the trace's events, ts/dur in microseconds of the trace's clock
    marks: dict[str, int]  # mark name -> the rank's wall clock (ns) read inside it
    collectives: list[dict]  # Flight Recorder entries created within the window
    clock: RankClock = field(default_factory=RankClock)
    p2p: list[dict] = field(default_factory=list)  # engine/p2p_log.py's notes
    fr_lost: int = 0  # entries of the window the recorder's ring dropped
    group_ranks: dict[str, list[int]] = field(default_factory=dict)  # group name -> ranks
    trace_off_us: float = 0.0  # trace clock -> the rank's wall clock (marks)
    refine_us: float = 0.0  # the collectives' correction, within the store's uncertainty
    cache: dict = field(default_factory=dict, repr=False)
    given: Summary | None = None  # the rank's own summary (its events stay on the rank)

    @property
    def shift_us(self) -> float:
        """Trace clock -> the kernel's clock (µs)."""
        return self.trace_off_us - self.clock.offset_ns / 1000 + self.refine_us

    def wall_to_trace_us(self, wall_ns: float) -> float:
        return wall_ns / 1000 - self.trace_off_us


def summary(t: RankTrace) -> Summary:
    """The rank's Summary: the one it sent, else computed from its events (once; a test
    that changes the events clears ``t.cache``)."""
    if t.given is not None:
        return t.given
    cached = t.cache.get("summary")
    if cached is None:
        cached = t.cache["summary"] = summarize(t)
    return cached


def summarize(t: RankTrace) -> Summary:
    """Everything per rank, in few passes over its events: the marks' offset, the window,
    the ops (comm_ops.py), the compute spans and self times, and what the merged trace
    needs (trace_merge.py)."""
    marks = {e["name"]: e for e in t.events if e.get("name") in k.MARKS and k.is_span(e)}
    t.trace_off_us = _offset_from_marks(t, marks.values())
    lo, hi = _window(t, marks)
    by_cat: dict = {}
    for e in t.events:
        by_cat.setdefault(e.get("cat"), []).append(e)
    cpu = by_cat.get("cpu_op", [])
    # nccl_ops reads every category but cpu_op's record_param_comms; gloo_ops the
    # annotations: the 15k dispatcher ops of a training loop go to neither
    comm = [e for c, evs in by_cat.items() if c != "cpu_op" for e in evs]
    comm += [e for e in cpu if e.get("name") == k.PARAM_COMMS]
    found, unmeasured = nccl_ops.ops(comm, t.rank, t.collectives, t.wall_to_trace_us, t.group_ranks)
    found += gloo_ops.ops(
        by_cat.get("user_annotation", []), t.rank, t.collectives, t.fr_lost, t.p2p,
        t.wall_to_trace_us,
    )  # fmt: skip
    compute, per_name = _compute(t, by_cat, marks, lo, hi)
    kept = [e["ts"] for e in t.events if "ts" in e and e.get("ph") != "M"]
    flows = {(e.get("cat"), e["id"]) for e in t.events
             if e.get("ph") in k.FLOW_PHASES and "id" in e}  # fmt: skip
    return Summary(
        trace_off_us=t.trace_off_us,
        window=(lo, hi),
        ops=[op for op in found if lo <= op.start <= hi],
        unmeasured=unmeasured,
        compute=intervals.clip(intervals.union(compute), lo, hi),
        per_name=per_name,
        first_ts=min(kept, default=None),
        thread_names=_thread_names(t.events),
        flows=len(flows),
    )


def _thread_names(events: list[dict]) -> list[dict]:
    """The rank's thread and stream names (metadata), the first of each (name, tid): a CPU
    thread and a stream of the same number keep the first."""
    out, seen = [], set()
    for e in events:
        if e.get("ph") != "M" or e.get("name") in k.PROCESS_META:
            continue
        key = (e.get("name"), e.get("tid"))
        if key not in seen:
            seen.add(key)
            out.append({"name": e["name"], "tid": e.get("tid"), "args": e.get("args", {})})
    return out


def _offset_from_marks(t: RankTrace, marks) -> float:
    """Trace clock -> the rank's wall clock (µs). Each mark read the wall clock somewhere
    inside its span, so the offset lies in [wall - span's end, wall - span's start] of every
    mark: the middle of where they all agree, as tight as the shortest mark. The median of
    the spans' middles was off by hundreds of µs when two of four marks were long (a mark
    takes 40-70 µs, but 0.9-5 ms where the thread was descheduled inside it, measured on 4
    CPU ranks), and then gloo_ops, which matches each Flight Recorder entry with the first
    event that started after it was made (25 µs of slack), numbers the collectives one off
    (likely what the suite once saw: 3 of 4 found, the wrong rank named last). Where the
    spans do not overlap (the wall clock stepped), the median of their middles."""
    spans = [
        (t.marks[ev["name"]] / 1000 - k.end(ev), t.marks[ev["name"]] / 1000 - ev["ts"])
        for ev in marks
        if ev["name"] in t.marks
    ]
    if not spans:
        return 0.0
    lo, hi = max(a for a, _ in spans), min(b for _, b in spans)
    if lo <= hi:
        return (lo + hi) / 2
    return statistics.median((a + b) / 2 for a, b in spans)


def trace_offset_us(trace: RankTrace) -> float:
    """Trace clock -> the rank's wall clock (µs), from the mark events."""
    return summary(trace).trace_off_us


def _window(t: RankTrace, found: dict) -> tuple[float, float]:
    for first, last in ((CELL_START, CELL_END), (START_MARK, STOP_MARK)):
        if first in found and last in found:
            return found[first]["ts"], k.end(found[last])
    times = [e["ts"] for e in t.events if k.is_span(e)]
    return (min(times), max(times)) if times else (0.0, 0.0)


def window(t: RankTrace) -> tuple[float, float]:
    """The rank's cell on its trace clock: its cell marks (the profiler's start and stop
    marks from an engine without them; else the trace's extent)."""
    return summary(t).window


def cell_thread(events: list[dict]):
    """The thread the cell ran on (its start mark's)."""
    for name in (CELL_START, START_MARK):
        for e in events:
            if e.get("name") == name:
                return e.get("tid")
    return None


def ops(t: RankTrace) -> tuple[list[CommOp], int]:
    """The rank's collective and p2p ops within its window (trace clock), and how many NCCL
    ops had no GPU span to measure."""
    s = summary(t)
    return s.ops, s.unmeasured


def _compute(t: RankTrace, by_cat: dict, marks: dict, lo: float, hi: float):
    """The rank's compute spans (trace clock) and self time per op name (µs: an op's time
    less its children's, so that a parent does not count what its children did), of the
    ops overlapping [lo, hi]: a GPU rank's kernels (NCCL's aside) and copies; a CPU rank's
    cell-thread ops (c10d's enqueues aside)."""
    if by_cat.get("kernel"):
        found = [e for c in k.GPU_WORK for e in by_cat.get(c, []) if not k.is_nccl_kernel(e)]
        timed = [(e, e.get("dur", 0)) for e in found if k.is_span(e)]
        timed = [(e["ts"], e["ts"] + d, str(e.get("name", "")), d) for e, d in timed]
    else:
        main = next((marks[n].get("tid") for n in (CELL_START, START_MARK) if n in marks), None)
        if main is None:
            main = cell_thread(t.events)
        found = [
            e
            for e in by_cat.get("cpu_op", [])
            if e.get("tid") == main and e.get("ph") == "X" and "ts" in e
        ]
        timed = [
            (a, b, name, own)
            for a, b, name, own in _self_times(found)
            if name != k.PARAM_COMMS and not name.startswith("c10d::")
        ]
    spans, per_name = [], {}
    for a, b, name, own in timed:
        if b > lo and a < hi:
            spans.append((a, b))
            per_name[name] = per_name.get(name, 0.0) + own
    return spans, per_name


def _self_times(events: list[dict]) -> list[tuple[float, float, str, float]]:
    """One thread's nested events as (start, end, name, self time: its duration less its
    direct children's), by start, outer first. (Tuples sorted in C and a stack of ends:
    the 15k ops of a training loop in a few ms.)"""
    durs = [e.get("dur", 0) for e in events]
    order = sorted(zip([e["ts"] for e in events], [-d for d in durs], range(len(events))))
    own = [float(d) for d in durs]
    ends: list[float] = []  # the open events' ends and indexes, outermost first
    opened: list[int] = []
    for ts, minus_dur, i in order:
        while ends and ends[-1] <= ts:
            ends.pop()
            opened.pop()
        if opened:
            own[opened[-1]] += minus_dur
        ends.append(ts - minus_dur)
        opened.append(i)
    return [
        (ts, ts - minus_dur, str(events[i].get("name", "")), max(0.0, own[i]))
        for ts, minus_dur, i in order
    ]
