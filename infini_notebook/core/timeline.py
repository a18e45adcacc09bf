"""One timeline from every rank's profiler trace (``%%dist_profile``). Pure: traces, clock
samples and Flight Recorder entries in; aligned events, per-rank and per-collective rows out.

Clocks. Each rank's trace has its own time base; a marker the rank records while reading
its wall clock (``trace_offset_us``) maps it to the rank's wall clock, and the kernel's
round trips through the store map that to the kernel's (``RankClock``: the sample with the
tightest round trip, the true offset within half of it). The collectives refine it: the
same collective (group, sequence number) ends at about the same moment on every member, so
each rank is shifted by the median gap between its ends and the others', kept within the
store sample's uncertainty.

Accounting, per rank over the profiled window: compute (its main thread's top-level ops,
GPU kernels), communication (collective work), wait (the part of a collective spent for
the last member to arrive: arrivals are the Flight Recorder's ``time_created_ns``) and idle
(the rest: Python between ops, sleeps, the GPU idle).
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field

START_MARK, STOP_MARK = "infini::profile_start", "infini::profile_stop"
COLLECTIVE_PREFIXES = ("gloo:", "nccl:", "ucc:", "mpi:")


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
    marks: dict[str, int]  # START_MARK/STOP_MARK -> the rank's wall clock (ns) inside them
    collectives: list[dict]  # Flight Recorder entries created within the window
    clock: RankClock = field(default_factory=RankClock)
    trace_off_us: float = 0.0  # trace clock -> the rank's wall clock (markers)
    refine_us: float = 0.0  # the collectives' correction, within the store's uncertainty
    cache: dict = field(default_factory=dict, repr=False)

    @property
    def shift_us(self) -> float:
        """Trace clock -> the kernel's clock (µs)."""
        return self.trace_off_us - self.clock.offset_ns / 1000 + self.refine_us

    def wall_to_kernel_us(self, wall_ns: float) -> float:
        return wall_ns / 1000 - self.clock.offset_ns / 1000 + self.refine_us


def trace_offset_us(trace: RankTrace) -> float:
    """Trace clock -> the rank's wall clock (µs), from the marker events."""
    gaps = []
    for ev in trace.events:
        if ev.get("name") in trace.marks and ev.get("ph") == "X":
            gaps.append(trace.marks[ev["name"]] / 1000 - (ev["ts"] + ev.get("dur", 0) / 2))
    return statistics.median(gaps) if gaps else 0.0


def is_collective(ev: dict) -> bool:
    name = str(ev.get("name", ""))
    return ev.get("ph") == "X" and name.startswith(COLLECTIVE_PREFIXES)


def collective_spans(trace: RankTrace) -> list[dict]:
    """The rank's collectives in its window, each with the group, sequence number, arrival
    (Flight Recorder) and, where the trace has its work event, start and end (µs, kernel
    clock). Matched in order per name: the n-th ``gloo:all_reduce`` entry is the n-th
    ``gloo:all_reduce`` event, when the counts agree. Without Flight Recorder entries (a
    torch that keeps none), the events alone, numbered in order per name, each arriving
    at its start. Cached per clock shift."""
    cached = trace.cache.get("spans")
    if cached is not None and cached[0] == (trace.shift_us, trace.refine_us):
        return cached[1]
    by_name: dict[str, list[dict]] = {}
    for ev in sorted((e for e in trace.events if is_collective(e)), key=lambda e: e["ts"]):
        by_name.setdefault(ev["name"], []).append(ev)
    entries = sorted(trace.collectives, key=lambda e: e["time_created_ns"])
    counts = Counter(entry.get("profiling_name", "") for entry in entries)
    seen: dict[str, int] = {}
    out = []
    for entry in entries:
        name = entry.get("profiling_name", "")
        i = seen.get(name, 0)
        seen[name] = i + 1
        events = by_name.get(name, [])
        ev = events[i] if len(events) == counts[name] else None
        pg = list(entry.get("process_group") or ["", ""])
        out.append(
            {
                "rank": trace.rank,
                "name": name,
                "pg": pg[0],  # the group's name: the same on its members, unlike others'
                "group": pg[-1] or pg[0],  # its description, to show ("default_pg")
                "seq": entry.get("collective_seq_id"),
                "arrive": trace.wall_to_kernel_us(entry["time_created_ns"]),
                "start": None if ev is None else ev["ts"] + trace.shift_us,
                "end": None if ev is None else ev["ts"] + ev.get("dur", 0) + trace.shift_us,
            }
        )
    if not entries:  # no Flight Recorder here: the trace's own events, numbered in order
        for name, events in by_name.items():
            for i, ev in enumerate(events):
                start = ev["ts"] + trace.shift_us
                end = start + ev.get("dur", 0)
                out.append(dict(rank=trace.rank, name=name, pg="", group="", seq=i,
                                arrive=start, start=start, end=end))  # fmt: skip
    trace.cache["spans"] = ((trace.shift_us, trace.refine_us), out)
    return out


def align(traces: list[RankTrace]) -> None:
    """Set each trace's shift to the kernel's clock: markers, store samples, then the
    collectives' ends (see the module's docstring)."""
    for t in traces:
        t.trace_off_us, t.refine_us = trace_offset_us(t), 0.0
    ends: dict[tuple, dict[int, float]] = {}
    for t in traces:
        for c in collective_spans(t):
            if c["end"] is not None:
                ends.setdefault((c["pg"], c["seq"], c["name"]), {})[t.rank] = c["end"]
    for t in traces:
        gaps = [
            statistics.median(v for r, v in members.items() if r != t.rank) - members[t.rank]
            for members in ends.values()
            if t.rank in members and len(members) > 1
        ]
        if gaps:
            bound = t.clock.rtt_ns / 2000  # µs: where the store sample puts the true offset
            t.refine_us = max(-bound, min(bound, statistics.median(gaps)))


def merged(traces: list[RankTrace], hosts: dict[int, str] | None = None) -> dict:
    """One Chrome/Perfetto trace: a process track per rank, on the kernel's clock, time 0
    at the earliest event. Moves the traces' events there in place (54k events: a copy
    of each doubled the merge's time), so take the tables from the traces first."""
    hosts = hosts or {}
    kept = [(t, [e for e in t.events if "ts" in e and e.get("ph") != "M"]) for t in traces]
    zero = min((e["ts"] + t.shift_us for t, evs in kept for e in evs), default=0.0)
    events = []
    for t, evs in kept:
        label = f"rank {t.rank}" + (f" ({hosts[t.rank]})" if t.rank in hosts else "")
        events.append({"ph": "M", "name": "process_name", "pid": t.rank, "args": {"name": label}})
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": t.rank, "args": {"sort_index": t.rank}}
        )
        shift = t.shift_us - zero
        for e in evs:
            e["pid"], e["ts"] = t.rank, round(e["ts"] + shift, 3)
        events += evs
        t.events = []  # moved: the trace no longer holds them on its own clock
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"zero_us": zero}}


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _window(t: RankTrace) -> tuple[float, float]:
    marks = [e for e in t.events if e.get("name") in (START_MARK, STOP_MARK)]
    if len(marks) == 2:
        lo, hi = sorted(e["ts"] + t.shift_us for e in marks)
        return lo, hi
    times = [e["ts"] + t.shift_us for e in t.events if "ts" in e and e.get("ph") == "X"]
    return (min(times), max(times)) if times else (0.0, 0.0)


def collective_rows(traces: list[RankTrace]) -> list[dict]:
    """Per collective (group, seq, name) with every member seen: who arrived last, how
    far apart the arrivals were, the wait that caused the others, how far apart the ends
    are on the one clock."""
    found: dict[tuple, list[dict]] = {}
    for t in traces:
        for c in collective_spans(t):
            found.setdefault((c["pg"], c["seq"], c["name"]), []).append(c)
    rows = []
    for (_, seq, name), members in found.items():
        if len(members) < 2:
            continue
        last = max(members, key=lambda c: c["arrive"])
        first = min(c["arrive"] for c in members)
        ends = [c["end"] for c in members if c["end"] is not None]
        rows.append(
            {
                "collective": name,
                "group": members[0]["group"],
                "seq": seq,
                "ranks": len(members),
                "last_rank": last["rank"],
                "arrival_spread_ms": (last["arrive"] - first) / 1000,
                "wait_caused_ms": sum(last["arrive"] - c["arrive"] for c in members) / 1000,
                "end_spread_ms": (max(ends) - min(ends)) / 1000 if len(ends) > 1 else None,
                "at_ms": first,  # made relative below
            }
        )
    zero = min((_window(t)[0] for t in traces), default=0.0)
    for row in rows:
        row["at_ms"] = (row["at_ms"] - zero) / 1000
    return sorted(rows, key=lambda r: r["at_ms"])


def _short(op: str) -> str:
    """An op's name without autograd's long prefix."""
    return op.removeprefix("autograd::engine::evaluate_function: ")


def rank_rows(traces: list[RankTrace], top: int = 3) -> list[dict]:
    """Per rank: wall, compute, communication, wait, idle (ms) and its top ops."""
    arrivals: dict[tuple, float] = {}
    spans = {t.rank: collective_spans(t) for t in traces}
    for cs in spans.values():
        for c in cs:
            key = (c["pg"], c["seq"], c["name"])
            arrivals[key] = max(arrivals.get(key, float("-inf")), c["arrive"])
    rows = []
    for t in traces:
        lo, hi = _window(t)
        main = {e.get("tid") for e in t.events if e.get("name") == START_MARK}
        compute, ops = [], {}
        for e in t.events:
            if e.get("ph") != "X" or "ts" not in e or is_collective(e):
                continue
            name = str(e.get("name", ""))
            if name in (START_MARK, STOP_MARK) or name.startswith("c10d::"):
                continue
            gpu = e.get("cat") == "kernel" and not name.lower().startswith("nccl")
            if gpu or (e.get("cat") == "cpu_op" and e.get("tid") in main):
                a = e["ts"] + t.shift_us
                compute.append((a, a + e.get("dur", 0)))
                ops[name] = ops.get(name, 0.0) + e.get("dur", 0)
        comm, wait = [], 0.0
        for c in spans[t.rank]:
            if c["start"] is not None:
                comm.append((c["start"], c["end"]))
                late = arrivals[(c["pg"], c["seq"], c["name"])] - c["arrive"]
                wait += max(0.0, min(late, c["end"] - c["start"]))
        busy = _union(comm)
        rows.append(
            {
                "rank": t.rank,
                "wall_ms": (hi - lo) / 1000,
                "compute_ms": _union(compute) / 1000,
                "communication_ms": max(0.0, busy - wait) / 1000,
                "wait_ms": wait / 1000,
                "idle_ms": max(0.0, (hi - lo) - _union(compute + comm)) / 1000,
                "top_ops": ", ".join(
                    _short(n) for n, _ in sorted(ops.items(), key=lambda x: -x[1])[:top]
                ),
            }
        )
    return rows
