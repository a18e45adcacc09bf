"""One timeline from every rank's profiler trace (``%%dist_profile``). Pure: traces, clock
samples, Flight Recorder entries and p2p notes in; per-rank and per-collective rows out
(the merged Chrome trace: trace_merge.py).

Window. A rank's figures cover its cell: from the mark the rank records as the cell's code
starts to the one it records once the cell has ended (its device work done), not the
profiler's start and stop, which the kernel's round trips put at different moments on
different ranks.

Clocks. Each rank's trace has its own time base; marks the rank records while reading its
wall clock map it to the rank's wall clock (``trace_offset_us``), and the kernel's round
trips through the store map that to the kernel's (``RankClock``: the sample with the
tightest round trip, the true offset within half of it). The collectives refine it: the
same collective ends at about the same moment on every member, so the ranks' clocks are
moved by the least-squares fit of their ends (clockfit.py), each within its store sample's
uncertainty.

Accounting, per rank over its window, as time on the rank's timeline (unions of intervals,
in this order, each less what the ones before it took; they add up to the wall time):
compute (a GPU rank: its kernels and copies; a CPU rank: its cell thread's ops), wait
(inside a collective or p2p op before its last peer arrived: from the rank's arrival to the
last member's), communication (the rest of its collective and p2p ops) and idle (the
rest: Python between ops, sleeps, the GPU with nothing to do). Arrival is when the rank's
part of the op began to run: an NCCL kernel's start on the GPU, a gloo worker taking the
work, a gloo send or recv posted. Wait is measured only for ops matched on every member
(comm_ops.py names them); an op the trace cannot match counts as communication, and the
rows say how many ops that is.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from . import clockfit, gloo_ops, intervals, nccl_ops, recorder
from . import kineto as k
from .comm_ops import CommOp
from .kineto import CELL_END, CELL_START, START_MARK, STOP_MARK  # noqa: F401 (re-exported)
from .ranks import rank_label


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
    gaps = []
    for ev in marks:
        if ev["name"] in t.marks:
            gaps.append(t.marks[ev["name"]] / 1000 - (ev["ts"] + ev.get("dur", 0) / 2))
    return statistics.median(gaps) if gaps else 0.0


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


def align(traces: list[RankTrace]) -> None:
    """Set each trace's shift to the kernel's clock: marks, store samples, then the fit of
    the collectives' ends (see the module's docstring)."""
    for t in traces:
        t.trace_off_us, t.refine_us = summary(t).trace_off_us, 0.0
    if len(traces) < 2:
        return
    ends: dict[tuple, dict[int, float]] = {}
    for t in traces:
        for op in ops(t)[0]:
            for key in op.keys:
                if key[0] == "c":
                    ends.setdefault(key, {})[t.rank] = op.end + t.shift_us
    reference = min(traces, key=lambda t: (t.clock.rtt_ns, t.rank))
    bounds = {t.rank: (t.clock.rtt_ns + reference.clock.rtt_ns) / 2000 for t in traces}
    moves = clockfit.fit(list(ends.values()), bounds, reference.rank)
    for t in traces:
        t.refine_us = moves.get(t.rank, 0.0)


@dataclass
class _Placed:
    """An op on the kernel's clock, with the peers that share its keys."""

    rank: int
    op: CommOp
    start: float
    end: float


def _placed(traces: list[RankTrace]) -> dict[int, list[_Placed]]:
    return {
        t.rank: [
            _Placed(t.rank, op, op.start + t.shift_us, op.end + t.shift_us) for op in ops(t)[0]
        ]
        for t in traces
    }


def _members(placed: dict[int, list[_Placed]]) -> dict[tuple, list[_Placed]]:
    found: dict[tuple, list[_Placed]] = {}
    for ps in placed.values():
        for p in ps:
            for key in p.op.keys:
                found.setdefault(key, []).append(p)
    return found


def _group_ranks(traces: list[RankTrace]) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for t in traces:
        found.update({g: r for g, r in t.group_ranks.items() if r})
    return found


def _sizes(traces: list[RankTrace]) -> dict[str, int]:
    return {g: len(r) for g, r in _group_ranks(traces).items()}


def _group_label(name: str, desc: str, ranks: list[int] | None) -> str:
    """A group as the rows show it: its description (``world`` for the default group, the
    session's ``inb_tp`` as ``tp``) and, for a subgroup, its ranks ("tp [ranks 2-3]"):
    every tp group shares the description."""
    label = recorder.group_label(desc) or name
    return f"{label} {rank_label(ranks)}" if ranks and label != "world" else label


def _complete(key: tuple, members: list[_Placed], sizes: dict[str, int]) -> bool:
    """Whether every member of the op is in the traces: both ends of a message, every
    rank of a collective's group (where its size is known; else at least two)."""
    ranks = {m.rank for m in members}
    if key[0] == "p":
        return ranks == {key[2], key[3]} or (key[2] == key[3] and len(members) == 2)
    return len(ranks) == sizes.get(key[1], max(2, len(ranks)))


def _last_arrival(p: _Placed, members, sizes) -> float | None:
    """The latest arrival among the op's peers, None where one is missing."""
    last = p.start
    for key in p.op.keys:
        if not _complete(key, members[key], sizes):
            return None
        last = max(last, max(m.start for m in members[key]))
    return last if p.op.keys else None


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


def _top(per_name: dict[str, float], top: int) -> str:
    """The ops that took the most self time, with their share of it: 'aten::mm 62 %'."""
    total = sum(per_name.values())
    best = sorted(per_name.items(), key=lambda x: -x[1])[:top]
    return ", ".join(f"{_short(name)} {100 * v / total:.0f} %" for name, v in best if total)


def _short(op: str, width: int = 48) -> str:
    """An op's name without autograd's long prefix, cut to ``width``."""
    op = op.removeprefix("autograd::engine::evaluate_function: ")
    return op if len(op) <= width else op[: width - 1] + "…"


def rank_rows(traces: list[RankTrace], top: int = 3) -> list[dict]:
    """Per rank: wall, compute, wait, communication, idle (ms; they add up to wall), the
    ops that took its compute time (self time, with their share), how many collective/p2p
    ops it ran in the cell and of those how many were matched on every member (wait is
    measured for those; None where none was)."""
    placed = _placed(traces)
    members = _members(placed)
    sizes = _sizes(traces)
    rows = []
    for t in traces:
        lo, hi = (x + t.shift_us for x in window(t))
        own = summary(t)
        compute = [(a + t.shift_us, b + t.shift_us) for a, b in own.compute]
        per_name = own.per_name
        comm, wait, matched = [], [], 0
        for p in placed[t.rank]:
            comm.append((p.start, p.end))
            last = _last_arrival(p, members, sizes)
            if last is not None:
                matched += 1
                wait.append((p.start, min(p.end, last)))
        parts = intervals.partition(lo, hi, [compute, wait, comm])
        n = len(placed[t.rank])
        rows.append(
            {
                "rank": t.rank,
                "wall_ms": (hi - lo) / 1000,
                "compute_ms": parts[0] / 1000,
                "communication_ms": parts[2] / 1000,
                "wait_ms": parts[1] / 1000 if matched or not n else None,
                "idle_ms": parts[3] / 1000,
                "ops": n,
                "matched": matched,
                "top_ops": _top(per_name, top),
            }
        )
    return rows


def collective_rows(traces: list[RankTrace]) -> list[dict]:
    """Per collective (or message) of the cell with every member seen: its number in the
    cell (``n``, a group's collectives from 1, a pair's messages from 1), who arrived last,
    how far apart the arrivals were, the waiting it caused (the members' time from their
    arrival to the last one's, summed; collectives that overlap share that time), and how
    far apart the ends are on the one clock."""
    placed = _placed(traces)
    members = _members(placed)
    sizes = _sizes(traces)
    group_ranks = _group_ranks(traces)
    zero = min((window(t)[0] + t.shift_us for t in traces), default=0.0)
    first: dict[tuple, int] = {}  # a group's (a pair's) first number in the cell
    for key in members:
        first[key[:-1]] = min(first.get(key[:-1], key[-1]), key[-1])
    rows = []
    for key, ms in members.items():
        if not _complete(key, ms, sizes):
            continue
        last = max(ms, key=lambda m: m.start)
        start = min(m.start for m in ms)
        ends = [m.end for m in ms]
        rows.append(
            {
                "collective": _label(key, ms),
                "group": _group_label(
                    key[1],
                    next((m.op.group for m in ms if m.op.group), ""),
                    group_ranks.get(key[1]),
                ),
                "n": key[-1] - first[key[:-1]] + 1,
                "ranks": len(ms),
                "last_rank": last.rank,
                "arrival_spread_ms": (last.start - start) / 1000,
                "wait_caused_ms": sum(min(last.start, m.end) - m.start for m in ms) / 1000,
                "end_spread_ms": (max(ends) - min(ends)) / 1000,
                "at_ms": (start - zero) / 1000,
            }
        )
    return sorted(rows, key=lambda r: r["at_ms"])


@dataclass
class Verdict:
    """The profile's answer in one sentence, and the rank it names (the figure marks it):
    it arrived last at ``last`` of the ``of`` matched ops it took part in."""

    text: str
    rank: int | None = None
    last: int = 0
    of: int = 0


def verdict(traces: list[RankTrace]) -> Verdict:
    """Who made the others wait, and how long: the rank whose late arrivals cost its peers
    the most waiting (each peer's wait for it a union of intervals, as in ``rank_rows``)."""
    placed = _placed(traces)
    sizes = _sizes(traces)
    done = {k: ms for k, ms in _members(placed).items() if _complete(k, ms, sizes)}
    if not done:
        if not any(placed.values()):
            return Verdict("No collective or message in this cell: no rank waited for another.")
        return Verdict(
            "No collective was seen on every member: no wait is measured (see the note)."
        )
    waits: dict[int, dict[int, list]] = {}  # last rank -> peer -> its waits for it
    for ms in done.values():
        last = max(ms, key=lambda m: m.start)
        for m in ms:
            if m.rank != last.rank:
                span = (m.start, min(m.end, last.start))
                waits.setdefault(last.rank, {}).setdefault(m.rank, []).append(span)
    waited = {s: {p: intervals.length(w) / 1000 for p, w in ps.items()} for s, ps in waits.items()}
    wall = {t.rank: (window(t)[1] - window(t)[0]) / 1000 for t in traces}
    s = max(waited, key=lambda r: (sum(waited[r].values()), -r), default=None)
    share = {p: w / wall[p] if wall[p] > 0 else 0.0 for p, w in waited.get(s, {}).items()}
    if max(share.values(), default=0.0) < 0.01:
        most = max((w for ps in waited.values() for w in ps.values()), default=0.0)
        return Verdict(
            f"The ranks arrived together at the "
            f"{_kind([ms[0].op for ms in done.values()]).removeprefix('1 ')}: "
            f"no rank waited more than {duration(most)}."
        )
    ops = [ms for ms in done.values() if any(m.rank == s for m in ms)]
    last = sum(max(ms, key=lambda m: m.start).rank == s for ms in ops)
    peers = sorted(waited[s])
    who = "the other ranks" if set(peers) | {s} == set(wall) else rank_label(peers)[1:-1]
    low, high = min(waited[s].values()), max(waited[s].values())
    if len(peers) == 1:
        how = f"{who} waited {duration(high)} for it ({share[peers[0]]:.0%} of its cell)"
    elif low >= 0.8 * high:
        mean, part = statistics.mean(waited[s].values()), statistics.mean(share.values())
        how = f"{who} waited {duration(mean)} each ({part:.0%} of the cell)"
    else:
        p = max(peers, key=lambda r: waited[s][r])
        how = f"{who} waited for it, up to {duration(high)} (rank {p}: {share[p]:.0%} of its cell)"
    text = f"rank {s} arrived last in {last} of {_kind([ms[0].op for ms in ops])}; {how}"
    return Verdict(text.replace("%", " %"), rank=s, last=last, of=len(ops))


def _kind(ops: list[CommOp]) -> str:
    """'3 all_reduces', '1 broadcast', '4 messages', '5 collectives'."""
    names = {op.name.split(":", 1)[-1] for op in ops}
    if all(op.p2p for op in ops):
        what = "message"
    elif any(op.p2p for op in ops):
        what = "collectives and message"
    else:
        what = names.pop() if len(names) == 1 else "collective"
    return f"{len(ops)} {what}{'s' if len(ops) != 1 else ''}"


def duration(ms: float) -> str:
    """'2.7 s', '45 ms', '0.3 ms'."""
    if ms >= 1000:
        return f"{ms / 1000:.1f} s"
    return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.1f} ms"


def _label(key: tuple, ms: list[_Placed]) -> str:
    if key[0] == "c":
        return ms[0].op.name
    backend = ms[0].op.name.split(":")[0]
    return f"{backend}:send/recv {key[2]}->{key[3]}"


def coverage(traces: list[RankTrace], rows: list[dict]) -> str:
    """What the wait figures cover, in words ('' where they cover every op)."""
    notes = []
    partial = [r for r in rows if r["matched"] < r["ops"]]
    if partial:
        shown = ", ".join(f"rank {r['rank']} {r['matched']} of {r['ops']}" for r in partial[:4])
        notes.append(
            f"wait is measured for the ops matched on every member ({shown}"
            f"{', ...' if len(partial) > 4 else ''}); the others count as communication"
        )
    lost = {  # NCCL's ops are named by the trace itself; gloo's need the recorder
        t.rank: t.fr_lost
        for t in traces
        if t.fr_lost and any(op.name.startswith(gloo_ops.PREFIX) for op in ops(t)[0])
    }
    if lost:
        notes.append(
            f"the Flight Recorder's ring (TORCH_FR_BUFFER_SIZE) dropped {max(lost.values())} "
            "of the cell's entries; gloo ops before its last entries are matched by order"
        )
    unmeasured = {t.rank: ops(t)[1] for t in traces if ops(t)[1]}
    if unmeasured:
        notes.append(
            f"{sum(unmeasured.values())} NCCL ops had no GPU activity in the trace (not counted)"
        )
    return "; ".join(notes)
