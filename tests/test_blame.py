"""The profile's verdict names the rank where a delay starts (core/blame.py, issue 50): a rank
late because it waited for another passes the blame on. Ground truth from a small simulation
of ranks (compute, gloo sends and receives, blocking and async all_reduces) in true time,
written as torch 2.13's traces (kineto_synth.py) on clocks that differ by days and jitter:
one injected straggler per scenario, 20 random variations of each, 20 of 20 right."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from kineto_synth import RankBuilder

from infini_notebook.core import blame
from infini_notebook.core import timeline as tl

MS = 1000.0  # µs


# ------------------------------------------------------------------ blame on its own


def test_a_wait_passes_along_the_ranks_that_were_waiting_themselves():
    """0 -> 1 -> 2: rank 0 late by 300 ms; rank 1 waits 300 ms for it, then needs 10 ms;
    rank 2 waits 310 ms for rank 1: 300 of them for rank 0 through rank 1, 10 for rank 1."""
    m = blame.Member
    ops = [
        [m(0, 300, 301), m(1, 0, 301)],  # 0 -> 1
        [m(1, 311, 312), m(2, 1, 312)],  # 1 -> 2
    ]
    waits = blame.Waits(ops)
    assert waits.chains(1) == {(0,): 300}
    assert waits.chains(2) == {(1, 0): 299, (1,): 11}  # rank 1's wait began at 0, rank 2's at 1
    assert blame.by_root(waits.chains(2)) == {0: 299, 1: 11}
    assert blame.through(blame.main_chain(waits.chains(2), 0)) == "through rank 1"
    assert blame.through((3, 2, 1, 0)) == "through ranks 1, 2 and 3"


def test_ops_that_overlap_count_a_wait_once_and_a_cycle_stops():
    m = blame.Member
    ops = [
        [m(0, 0, 100), m(1, 50, 100)],  # 0 waits 50 for 1
        [m(0, 10, 100), m(1, 60, 100)],  # at the same time, in an async op
        [m(1, 40, 100), m(0, 45, 100)],  # and 1 waits 5 for 0: a cycle
    ]
    waits = blame.Waits(ops)
    assert sum(waits.chains(0).values()) == pytest.approx(60)  # 0..60, once
    assert sum(waits.chains(1).values()) == pytest.approx(5)


# ------------------------------------------------------------------ a small simulation


@dataclass
class Rank:
    script: list
    t: float = 0.0
    pc: int = 0
    records: list = field(default_factory=list)
    pending: list = field(default_factory=list)  # async ops not yet waited for
    counts: dict = field(default_factory=dict)


class Sim:
    """Ranks run their scripts in true time (µs): ("compute", us), ("send"|"recv", peer),
    ("all_reduce", group) blocking, ("iall_reduce", group) async, ("wait",) for the async
    ones. A collective ends 2 ms after its last member arrived; a send 1 ms after it was
    posted (buffered), its receive 1 ms after both were."""

    def __init__(self, scripts: dict[int, list], groups: dict[str, list[int]]):
        self.ranks = {r: Rank(s) for r, s in scripts.items()}
        self.groups = groups
        self.ops: dict[tuple, dict] = {}  # op -> {rank: arrival}, and "end" once known
        self.run()

    def key(self, r: int, step: tuple) -> tuple:
        rank = self.ranks[r]
        if step[0] in ("send", "recv"):
            src, dst = (r, step[1]) if step[0] == "send" else (step[1], r)
            what = ("p", src, dst)
        else:
            what = ("c", step[1])
        n = rank.counts.get((what, rank.pc), None)
        if n is None:
            n = rank.counts[what] = rank.counts.get(what, 0) + 1
            rank.counts[(what, rank.pc)] = n
        return (*what, n)

    def members(self, key: tuple) -> list[int]:
        return [key[1], key[2]] if key[0] == "p" else self.groups[key[1]]

    def run(self) -> None:
        moved = True
        while moved:
            moved = False
            for r, rank in self.ranks.items():
                while rank.pc < len(rank.script) and self.step(r, rank):
                    moved = True
        assert all(k.pc == len(k.script) for k in self.ranks.values()), "deadlock"

    def end_of(self, key: tuple) -> float | None:
        op = self.ops.get(key, {})
        arrived = {m: op[m] for m in self.members(key) if m in op}
        if len(arrived) < len(self.members(key)):
            return None
        return max(arrived.values()) + (1 * MS if key[0] == "p" else 2 * MS)

    def step(self, r: int, rank: Rank) -> bool:
        step = rank.script[rank.pc]
        if step[0] == "compute":
            rank.records.append(("compute", rank.t, step[1]))
            rank.t += step[1]
        elif step[0] == "wait":
            ends = [self.end_of(k) for k in rank.pending]
            if None in ends:
                return False
            rank.t = max([rank.t, *ends])
            rank.pending = []
        else:
            key = self.key(r, step)
            self.ops.setdefault(key, {}).setdefault(r, rank.t)
            end = self.end_of(key)
            if step[0] == "iall_reduce":
                rank.records.append((step, key, rank.t))
                rank.pending.append(key)
                rank.t += 0.1 * MS
            elif step[0] == "send":
                rank.records.append((step, key, rank.t))
                rank.t += 1 * MS
            else:
                if end is None:
                    return False
                rank.records.append((step, key, self.ops[key][r]))
                rank.t = end
        rank.pc += 1
        return True

    def traces(self, rng: random.Random) -> list:
        out = []
        for r, rank in self.ranks.items():
            b = RankBuilder(r, rng.uniform(-1e12, 1e12), rng.uniform(-150, 150))
            b.cell(0.0, max(k.t for k in self.ranks.values()) + 5 * MS)
            for rec in rank.records:
                if rec[0] == "compute":
                    b.cpu_op("aten::mm", rec[1], rec[2])
                    continue
                step, key, arrive = rec
                end = self.end_of(key)
                if key[0] == "p":
                    b.gloo_p2p(
                        step[0], "0", step[1], arrive, arrive + 1 * MS if step[0] == "send" else end
                    )
                else:
                    desc = "default_pg" if key[1] == "0" else f"g{key[1]}"  # a worker each
                    b.gloo_collective("gloo:all_reduce", key[1], key[2], arrive - 20, arrive, end,
                                      worker=10 + int(key[1]), desc=desc)  # fmt: skip
            out.append(b.trace())
            out[-1].group_ranks = dict(self.groups)
        tl.align(out)
        return out


def jit(rng: random.Random, us: float) -> float:
    return us * rng.uniform(0.8, 1.2)


WORLD = {"0": [0, 1, 2, 3]}


def p2p_chain(rng):
    """0 -> 1 -> 2 -> 3, three steps; rank 0 sleeps before each send."""
    scripts = {r: [] for r in range(4)}
    for _ in range(3):
        scripts[0] += [("compute", jit(rng, 20 * MS)), ("compute", jit(rng, 300 * MS)),
                       ("send", 1)]  # fmt: skip
        for r in (1, 2):
            scripts[r] += [("recv", r - 1), ("compute", jit(rng, 5 * MS)), ("send", r + 1)]
        scripts[3] += [("recv", 2), ("compute", jit(rng, 5 * MS))]
    return scripts, WORLD


def late_send_then_all_reduce(rng):
    scripts = {
        0: [("compute", jit(rng, 300 * MS)), ("send", 1), ("all_reduce", "0")],
        1: [("recv", 0), ("compute", jit(rng, 2 * MS)), ("all_reduce", "0")],
        2: [("compute", jit(rng, 20 * MS)), ("all_reduce", "0")],
        3: [("compute", jit(rng, 20 * MS)), ("all_reduce", "0")],
    }
    return scripts, WORLD


def tp_then_dp(rng):
    """tp pairs {0,1} {2,3}, dp pairs {0,2} {1,3}; rank 0 late into its tp all_reduce."""
    groups = {"0": [0, 1, 2, 3], "1": [0, 1], "2": [2, 3], "3": [0, 2], "4": [1, 3]}
    tp, dp = {0: "1", 1: "1", 2: "2", 3: "2"}, {0: "3", 1: "4", 2: "3", 3: "4"}
    scripts = {}
    for r in range(4):
        late = jit(rng, 300 * MS) if r == 0 else 0.0
        scripts[r] = [("compute", jit(rng, 20 * MS) + late), ("all_reduce", tp[r]),
                      ("compute", jit(rng, 5 * MS)), ("all_reduce", dp[r])]  # fmt: skip
    return scripts, groups


def pipeline_1f1b(rng, slow=2, micro=4):
    """4 stages, one-forward-one-backward after a warm-up; stage ``slow`` computes 4x."""
    scripts = {}
    for s in range(4):
        f = jit(rng, 20 * MS) * (4 if s == slow else 1)
        warm = min(4 - s - 1, micro)
        fwd = [("recv", s - 1)] * (s > 0) + [("compute", f)] + [("send", s + 1)] * (s < 3)
        bwd = [("recv", s + 1)] * (s < 3) + [("compute", 2 * f)] + [("send", s - 1)] * (s > 0)
        steps = fwd * warm
        for _ in range(micro - warm):
            steps += fwd + bwd
        steps += bwd * warm
        scripts[s] = steps
    return scripts, WORLD


def ddp(rng, slow=1):
    """Forward, then 3 buckets of backward each all_reduced async, then wait; rank ``slow``
    computes 2x."""
    scripts = {}
    for r in range(4):
        k = 2.0 if r == slow else 1.0
        steps = []
        for _ in range(2):
            steps += [("compute", jit(rng, 30 * MS) * k)]
            for _ in range(3):
                steps += [("compute", jit(rng, 15 * MS) * k), ("iall_reduce", "0")]
            steps += [("wait",)]
        scripts[r] = steps
    return scripts, WORLD


@pytest.mark.parametrize(
    "scenario, root",
    [(p2p_chain, 0), (late_send_then_all_reduce, 0), (tp_then_dp, 0), (pipeline_1f1b, 2),
     (ddp, 1)],
)  # fmt: skip
def test_the_verdict_names_where_the_delay_starts_20_of_20(scenario, root):
    wrong = []
    for seed in range(20):
        rng = random.Random(seed)
        traces = Sim(*scenario(rng)).traces(rng)
        v = tl.verdict(traces)
        rows = tl.rank_rows(traces)
        if v.rank != root or any(
            not r["waited_for"].startswith(f"rank {root}") for r in rows if r["rank"] != root
        ):
            wrong.append((seed, v.text, [r["waited_for"] for r in rows]))
    assert not wrong, wrong


def test_the_chain_and_its_rows_say_whom_each_rank_waited_for_and_through_whom():
    """The issue's case: a p2p chain 0 -> 1 -> 2 -> 3 with rank 0 sleeping before each
    send was "rank 2 arrived last in 3 of 6 messages; rank 3 waited 604 ms for it"."""
    rng = random.Random(7)
    traces = Sim(*p2p_chain(rng)).traces(rng)
    v = tl.verdict(traces)
    assert v.text.startswith("rank 0 is where the delay starts: it arrived last in 3 of 3 "
                             "messages; the other ranks waited"), v.text  # fmt: skip
    assert v.text.endswith("rank 2 through rank 1, rank 3 through ranks 1 and 2"), v.text
    rows = {r["rank"]: r for r in tl.rank_rows(traces)}
    assert rows[1]["waited_for"] == "rank 0"
    assert rows[2]["waited_for"] == "rank 0 through rank 1"
    assert rows[3]["waited_for"] == "rank 0 through ranks 1 and 2"
    assert rows[0]["waited_for"] == ""
    for r in (1, 2, 3):  # each waited about 3 x 300 ms, whoever it waited on directly
        assert 3 * 0.8 * 300 <= rows[r]["wait_ms"] <= 3 * 1.2 * 320, rows[r]


def test_a_straggler_that_is_waited_for_directly_keeps_the_plain_verdict():
    rng = random.Random(3)
    scripts = {r: [("compute", (300 if r == 2 else 20) * MS), ("all_reduce", "0")]
               for r in range(4)}  # fmt: skip
    v = tl.verdict(Sim(scripts, WORLD).traces(rng))
    assert v.text.startswith("rank 2 arrived last in 1 of 1 all_reduce; the other ranks waited")
    assert "through" not in v.text


def test_a_second_straggler_in_another_group_is_named_too():
    """Rank 1 late 200 ms x 3 in tp {0,1}; rank 3 late 300 ms x 3 in tp {2,3}: rank 3 cost
    more and leads; rank 1, which cost rank 0 most of its cell, is named after it."""
    groups = {"0": [0, 1, 2, 3], "1": [0, 1], "2": [2, 3]}
    tp = {0: "1", 1: "1", 2: "2", 3: "2"}
    late = {1: 200 * MS, 3: 300 * MS}
    scripts = {
        r: [
            s
            for _ in range(3)
            for s in (("compute", 10 * MS + late.get(r, 0)), ("all_reduce", tp[r]))
        ]
        for r in range(4)
    }
    rng = random.Random(5)
    v = tl.verdict(Sim(scripts, groups).traces(rng))
    assert v.rank == 3 and v.text.startswith("rank 3 arrived last in 3 of 3 all_reduces"), v.text
    assert v.text.endswith("; also rank 1: rank 0 waited 600 ms for it"), v.text
