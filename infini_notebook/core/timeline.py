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

from . import clockfit, gloo_ops, intervals, nccl_ops
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

    @property
    def shift_us(self) -> float:
        """Trace clock -> the kernel's clock (µs)."""
        return self.trace_off_us - self.clock.offset_ns / 1000 + self.refine_us

    def wall_to_trace_us(self, wall_ns: float) -> float:
        return wall_ns / 1000 - self.trace_off_us


def trace_offset_us(trace: RankTrace) -> float:
    """Trace clock -> the rank's wall clock (µs), from the mark events."""
    gaps = []
    for ev in trace.events:
        if ev.get("name") in trace.marks and k.is_span(ev):
            gaps.append(trace.marks[ev["name"]] / 1000 - (ev["ts"] + ev.get("dur", 0) / 2))
    return statistics.median(gaps) if gaps else 0.0


def window(t: RankTrace) -> tuple[float, float]:
    """The rank's cell on its trace clock: its cell marks (the profiler's start and stop
    marks from an engine without them; else the trace's extent)."""
    found = {e["name"]: e for e in t.events if e.get("name") in k.MARKS and k.is_span(e)}
    for first, last in ((CELL_START, CELL_END), (START_MARK, STOP_MARK)):
        if first in found and last in found:
            return found[first]["ts"], k.end(found[last])
    times = [e["ts"] for e in t.events if k.is_span(e)]
    return (min(times), max(times)) if times else (0.0, 0.0)


def cell_thread(t: RankTrace):
    """The thread the cell ran on (its start mark's)."""
    for name in (CELL_START, START_MARK):
        for e in t.events:
            if e.get("name") == name:
                return e.get("tid")
    return None


def ops(t: RankTrace) -> tuple[list[CommOp], int]:
    """The rank's collective and p2p ops within its window (trace clock), and how many NCCL
    ops had no GPU span to measure. Cached per trace-to-wall offset."""
    cached = t.cache.get("ops")
    if cached is not None and cached[0] == t.trace_off_us:
        return cached[1]
    lo, hi = window(t)
    found, unmeasured = nccl_ops.ops(
        t.events, t.rank, t.collectives, t.wall_to_trace_us, t.group_ranks
    )
    found += gloo_ops.ops(t.events, t.rank, t.collectives, t.fr_lost, t.p2p, t.wall_to_trace_us)
    result = ([op for op in found if lo <= op.start <= hi], unmeasured)
    t.cache["ops"] = (t.trace_off_us, result)
    return result


def align(traces: list[RankTrace]) -> None:
    """Set each trace's shift to the kernel's clock: marks, store samples, then the fit of
    the collectives' ends (see the module's docstring)."""
    for t in traces:
        t.trace_off_us, t.refine_us = trace_offset_us(t), 0.0
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
    label = "world" if desc == "default_pg" else (desc.removeprefix("inb_") or name)
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


def _compute(t: RankTrace, lo: float, hi: float) -> tuple[list, dict[str, float]]:
    """The rank's compute spans (kernel clock) and time per op name: a GPU rank's kernels
    (NCCL's aside) and copies; a CPU rank's cell-thread ops (c10d's enqueues aside)."""
    gpu = any(e.get("cat") == "kernel" for e in t.events)
    main = cell_thread(t)
    spans, per_name = [], {}
    for e in t.events:
        if not k.is_span(e):
            continue
        name = str(e.get("name", ""))
        if gpu:
            keep = e.get("cat") in k.GPU_WORK and not k.is_nccl_kernel(e)
        else:
            keep = (
                e.get("cat") == "cpu_op"
                and e.get("tid") == main
                and name != k.PARAM_COMMS
                and not name.startswith("c10d::")
            )
        if keep:
            a = e["ts"] + t.shift_us
            if a + e.get("dur", 0) > lo and a < hi:
                spans.append((a, a + e.get("dur", 0)))
                per_name[name] = per_name.get(name, 0.0) + e.get("dur", 0)
    return spans, per_name


def _short(op: str, width: int = 48) -> str:
    """An op's name without autograd's long prefix, cut to ``width``."""
    op = op.removeprefix("autograd::engine::evaluate_function: ")
    return op if len(op) <= width else op[: width - 1] + "…"


def rank_rows(traces: list[RankTrace], top: int = 3) -> list[dict]:
    """Per rank: wall, compute, wait, communication, idle (ms; they add up to wall), its
    top ops, how many collective/p2p ops it ran in the cell and of those how many were
    matched on every member (wait is measured for those; None where none was)."""
    placed = _placed(traces)
    members = _members(placed)
    sizes = _sizes(traces)
    rows = []
    for t in traces:
        lo, hi = (x + t.shift_us for x in window(t))
        compute, per_name = _compute(t, lo, hi)
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
                "top_ops": ", ".join(
                    _short(name) for name, _ in sorted(per_name.items(), key=lambda x: -x[1])[:top]
                ),
            }
        )
    return rows


def collective_rows(traces: list[RankTrace]) -> list[dict]:
    """Per collective (or message) of the cells with every member seen: who arrived last,
    how far apart the arrivals were, the waiting it caused (the members' time from their
    arrival to the last one's, summed; collectives that overlap share that time), and how
    far apart the ends are on the one clock."""
    placed = _placed(traces)
    members = _members(placed)
    sizes = _sizes(traces)
    group_ranks = _group_ranks(traces)
    zero = min((window(t)[0] + t.shift_us for t in traces), default=0.0)
    rows = []
    for key, ms in members.items():
        if not _complete(key, ms, sizes):
            continue
        last = max(ms, key=lambda m: m.start)
        first = min(m.start for m in ms)
        ends = [m.end for m in ms]
        rows.append(
            {
                "collective": _label(key, ms),
                "group": _group_label(
                    key[1],
                    next((m.op.group for m in ms if m.op.group), ""),
                    group_ranks.get(key[1]),
                ),
                "seq": key[2] if key[0] == "c" else key[4],
                "ranks": len(ms),
                "last_rank": last.rank,
                "arrival_spread_ms": (last.start - first) / 1000,
                "wait_caused_ms": sum(min(last.start, m.end) - m.start for m in ms) / 1000,
                "end_spread_ms": (max(ends) - min(ends)) / 1000,
                "at_ms": (first - zero) / 1000,
            }
        )
    return sorted(rows, key=lambda r: r["at_ms"])


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
