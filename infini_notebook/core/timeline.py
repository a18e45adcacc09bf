"""One timeline from every rank's profiler trace (``%%dist_profile``). Pure: the ranks'
traces (rank_trace.py: each rank's window, ops and compute spans), clock samples, Flight
Recorder entries and p2p notes in; per-rank and per-collective rows and the verdict out
(the merged Chrome trace: trace_merge.py).

Clocks. Each rank's trace has its own time base; marks the rank records while reading its
wall clock map it to the rank's wall clock (``trace_offset_us``), and the kernel's round
trips through the store map that to the kernel's (``RankClock``: the sample with the
tightest round trip, the true offset within half of it). The collectives refine it: the
same collective ends at about the same moment on every member, so the ranks' clocks are
moved by the least-squares fit of their ends (clockfit.py), each within its store sample's
uncertainty.

Accounting, per rank over its window (its cell: rank_trace.py), as time on the rank's
timeline (unions of intervals, in this order, each less what the ones before it took; they
add up to the wall time): compute (a GPU rank: its kernels and copies; a CPU rank: its cell
thread's ops), wait (inside a collective or p2p op before its last peer arrived: from the
rank's arrival to the last member's), communication (the rest of its collective and p2p ops)
and idle (the rest: Python between ops, sleeps, the GPU with nothing to do). Arrival is when
the rank's part of the op began to run: an NCCL kernel's start on the GPU, a gloo worker
taking the work, a gloo send or recv posted. Wait is measured only for ops matched on every
member (comm_ops.py names them); an op the trace cannot match counts as communication, and
the rows say how many ops that is.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from . import blame, clockfit, gloo_ops, intervals, recorder
from .comm_ops import CommOp
from .rank_trace import RankTrace, ops, summary, window
from .ranks import format_ranks, rank_label


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


def _waits(traces: list[RankTrace], placed: dict[int, list[_Placed]], sizes) -> blame.Waits:
    """Every rank's waits in the ops seen on every member, less its compute, in its window:
    as ``rank_rows`` counts them; for blame's chains."""
    done = [ms for k, ms in _members(placed).items() if _complete(k, ms, sizes)]
    busy = {
        t.rank: [(a + t.shift_us, b + t.shift_us) for a, b in summary(t).compute] for t in traces
    }
    window_of = {t.rank: tuple(x + t.shift_us for x in window(t)) for t in traces}
    ops = [[blame.Member(m.rank, m.start, m.end) for m in ms] for ms in done]
    return blame.Waits(ops, busy, window_of)


def waited_for(chains: dict[tuple[int, ...], float]) -> str:
    """Where most of a rank's wait started, and through whom: 'rank 0 through ranks 2 and
    1'; '' where it did not wait."""
    roots = blame.by_root(chains)
    if not roots:
        return ""
    root = max(roots, key=lambda r: (roots[r], -r))
    how = blame.through(blame.main_chain(chains, root))
    return f"rank {root} {how}".strip()


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
    measured for those; None where none was), and where most of its wait started
    (``waited_for``: "rank 0 through ranks 2 and 1", blame.py)."""
    placed = _placed(traces)
    members = _members(placed)
    sizes = _sizes(traces)
    waits = _waits(traces, placed, sizes)
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
                "waited_for": waited_for(waits.chains(t.rank)),
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
                "ranks": format_ranks([m.rank for m in ms]),  # its members: "0-3", not 4
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
    """Who made the others wait, and how long: the rank where the delay starts (blame.py: a
    rank late because it waited for another passes the blame on), by the waiting it cost
    its peers, each peer's wait counted once."""
    placed = _placed(traces)
    sizes = _sizes(traces)
    done = {k: ms for k, ms in _members(placed).items() if _complete(k, ms, sizes)}
    if not done:
        if not any(placed.values()):
            return Verdict("No collective or message in this cell: no rank waited for another.")
        return Verdict(
            "No collective was seen on every member: no wait is measured (see the note)."
        )
    waits = _waits(traces, placed, sizes)
    chains = {t.rank: waits.chains(t.rank) for t in traces}
    cost: dict[int, dict[int, float]] = {}  # where a delay started -> peer -> its wait (ms)
    for peer, cs in chains.items():
        for root, us in blame.by_root(cs).items():
            cost.setdefault(root, {})[peer] = us / 1000
    wall = {t.rank: (window(t)[1] - window(t)[0]) / 1000 for t in traces}
    s = max(cost, key=lambda r: (sum(cost[r].values()), -r), default=None)
    share = {p: w / wall[p] if wall[p] > 0 else 0.0 for p, w in cost.get(s, {}).items()}
    if max(share.values(), default=0.0) < 0.01:
        most = max((w for ps in cost.values() for w in ps.values()), default=0.0)
        return Verdict(
            f"The ranks arrived together at the "
            f"{_kind([ms[0].op for ms in done.values()]).removeprefix('1 ')}: "
            f"no rank waited more than {duration(most)}."
        )
    ops = [ms for ms in done.values() if any(m.rank == s for m in ms)]
    last = sum(max(ms, key=lambda m: (m.start, m.rank)).rank == s for ms in ops)
    waited = cost[s]
    peers = sorted(waited)
    who = "the other ranks" if set(peers) | {s} == set(wall) else rank_label(peers)[1:-1]
    low, high = min(waited.values()), max(waited.values())
    if len(peers) == 1:
        how = f"{who} waited {duration(high)} for it ({share[peers[0]]:.0%} of its cell)"
    elif low >= 0.8 * high:
        mean, part = statistics.mean(waited.values()), statistics.mean(share.values())
        how = f"{who} waited {duration(mean)} each ({part:.0%} of the cell)"
    else:
        p = max(peers, key=lambda r: waited[r])
        how = f"{who} waited for it, up to {duration(high)} (rank {p}: {share[p]:.0%} of its cell)"
    main = {p: blame.main_chain(chains[p], s) for p in peers}
    passed = [f"rank {p} {blame.through(main[p])}" for p in peers if len(main[p]) > 1]
    if passed:  # the delay reached some peers through ranks that waited for it themselves
        text = (
            f"rank {s} is where the delay starts: it arrived last in {last} of "
            f"{_kind([ms[0].op for ms in ops])}; {how}; {', '.join(passed)}"
        )
    else:
        text = f"rank {s} arrived last in {last} of {_kind([ms[0].op for ms in ops])}; {how}"
    text += "".join(f"; {also}" for also in _other_roots(cost, wall, s))
    return Verdict(text.replace("%", " %"), rank=s, last=last, of=len(ops))


ALSO_SHARE = 0.1  # another root is named when a peer waited this much of its cell for it
ALSO_OF_FIRST = 0.25  # ... and at least this much of the longest wait the first one caused
ALSO_MAX = 2


def _other_roots(cost: dict[int, dict[int, float]], wall: dict[int, float], named: int):
    """Other ranks where a delay started (a straggler in another group), each named in a
    clause when it cost some peer ALSO_SHARE of its cell and ALSO_OF_FIRST of the longest
    wait the named rank caused (a few ms of jitter in a short cell is no straggler): 'also
    rank 1: rank 0 waited up to 600 ms for it'. The most costly first, at most ALSO_MAX."""
    first = max(cost.get(named, {}).values(), default=0.0)
    found = []
    for r, peers in cost.items():
        if r == named or not peers:
            continue
        worst = max(peers, key=lambda p: peers[p])
        if (
            wall.get(worst, 0) > 0
            and peers[worst] / wall[worst] >= ALSO_SHARE
            and peers[worst] >= ALSO_OF_FIRST * first
        ):
            found.append((sum(peers.values()), r, peers, worst))
    out = []
    for _, r, peers, worst in sorted(found, key=lambda x: (-x[0], x[1]))[:ALSO_MAX]:
        who = rank_label(sorted(peers))[1:-1]
        verb = "waited" if len(peers) == 1 else "waited for it, up to"
        tail = f"{duration(peers[worst])} for it" if len(peers) == 1 else duration(peers[worst])
        out.append(f"also rank {r}: {who} {verb} {tail}")
    return out


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
