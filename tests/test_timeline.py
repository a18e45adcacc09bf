"""The merged timeline's arithmetic (issues 31 and 39) on synthetic traces in torch 2.13's
schema (kineto_synth.py) with known truth: clocks off by known amounts, ranks that arrive
late by known amounts, more collectives than the Flight Recorder keeps, collectives that
overlap, NCCL's GPU kernels, messages between ranks and subgroups."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kineto_synth import MAIN, RankBuilder

from infini_notebook.core import clockfit, intervals, rank_trace, trace_merge
from infini_notebook.core import timeline as tl

STEP_US = 1_000_000  # true time between steps
LATE_US = 300_000


def rows_by_rank(traces):
    return {r["rank"]: r for r in tl.rank_rows(traces)}


def assert_adds_up(row):
    parts = [row["compute_ms"], row["communication_ms"], row["wait_ms"] or 0.0, row["idle_ms"]]
    assert all(p >= -1e-9 for p in parts), row
    assert sum(parts) == pytest.approx(row["wall_ms"], abs=1e-6), row


# ---------------------------------------------------------------- gloo, the straggler


def gloo_straggler(rank, trace_base_us, wall_off_us, clock_err_us=0.0, steps=3):
    """3 steps: a 50 ms op, then an all_reduce its worker takes at 100 ms (rank 2: 400 ms),
    which ends for everyone at 450 ms."""
    b = RankBuilder(rank, trace_base_us, wall_off_us, clock_err_us=clock_err_us)
    b.cell(0.0, steps * STEP_US)
    for step in range(steps):
        t0 = step * STEP_US
        b.cpu_op("aten::mm", t0, 50_000)
        arrive = t0 + 100_000 + (LATE_US if rank == 2 else 0)
        b.gloo_collective("gloo:all_reduce", "0", step + 1, arrive - 20, arrive, t0 + 450_000,
                          worker=7)  # fmt: skip
    return b


@pytest.fixture
def traces():
    # trace clocks days apart, wall clocks off by up to 0.15 ms; rank 1's store sample is
    # 150 µs off (it read its clock early in the round trip): the collectives correct that
    out = [
        gloo_straggler(0, 4e12, 0.0).trace(),
        gloo_straggler(1, 7e9, 150.0, clock_err_us=-150).trace(),
        gloo_straggler(2, -3e6, -120.0).trace(),
    ]
    tl.align(out)
    return out


def test_alignment_puts_each_collective_end_at_one_moment(traces):
    rows = tl.collective_rows(traces)
    assert len(rows) == 3
    for row in rows:
        assert row["end_spread_ms"] < 0.01, row  # µs after alignment, from days apart
        assert row["last_rank"] == 2
        assert row["arrival_spread_ms"] == pytest.approx(300, abs=0.5)
        assert row["wait_caused_ms"] == pytest.approx(600, abs=1)  # two ranks x 300 ms


def test_per_rank_accounting_adds_up_to_the_cell(traces):
    rows = rows_by_rank(traces)
    for r in (0, 1):
        assert rows[r]["wait_ms"] == pytest.approx(900, abs=1)  # 3 steps x 300 ms
        assert rows[r]["communication_ms"] == pytest.approx(150, abs=1)  # 3 x 50 ms
    assert rows[2]["wait_ms"] == pytest.approx(0, abs=0.5)
    assert rows[2]["idle_ms"] == pytest.approx(rows[0]["idle_ms"] + 900, abs=1)
    for row in rows.values():
        assert row["wall_ms"] == pytest.approx(3000, abs=0.1)
        assert row["compute_ms"] == pytest.approx(150, abs=0.1)
        assert row["top_ops"] == "aten::mm 100 %"
        assert (row["ops"], row["matched"]) == (3, 3)
        assert_adds_up(row)


def test_long_marks_do_not_move_the_clock_and_the_collectives_keep_their_numbers():
    """A mark is a span with the wall clock read somewhere inside; a thread descheduled in
    one makes it long (0.9-5 ms on a loaded machine). Two long marks read early in them put
    the median of the marks' middles ~190 µs off, and every Flight Recorder entry then
    seemed made after its own collective started: each was matched with the next one (3
    of 4 found, numbered one off). Where the marks' spans agree, the offset is exact."""
    steps, traces = 4, []
    for rank in range(3):
        b = RankBuilder(rank, 1e12 * (rank + 1), 10.0 * rank)
        end = steps * STEP_US
        b.mark(rank_trace.START_MARK, -6000, dur=5000, read_at=200)
        b.mark(rank_trace.CELL_START, 0, dur=60, read_at=25)
        b.mark(rank_trace.CELL_END, end - 1000, dur=960, read_at=100)
        b.mark(rank_trace.STOP_MARK, end + 10, dur=57, read_at=30)
        for step in range(steps):
            t0 = step * STEP_US
            arrive = t0 + 100_000 + (LATE_US if rank == 2 else 0)
            b.gloo_collective("gloo:all_reduce", "0", step + 1, arrive - 20, arrive,
                              t0 + 450_000, worker=7)  # fmt: skip
        traces.append(b.trace())
    tl.align(traces)
    for t in traces:  # trace clock -> the rank's wall clock, to 1 µs
        want = 10.0 * t.rank - 1e12 * (t.rank + 1)
        assert rank_trace.trace_offset_us(t) == pytest.approx(want, abs=1), t.rank
    rows = [r for r in tl.collective_rows(traces) if r["group"] == "world"]
    assert [r["n"] for r in rows] == [1, 2, 3, 4], rows
    assert all(r["last_rank"] == 2 for r in rows), rows


def test_the_window_is_the_cell_not_the_profilers_start_and_stop():
    """Rank 1's profiler started 2.2 s before its cell (a loaded machine): not its time."""
    out = []
    for r in range(2):
        b = RankBuilder(r, 1e6 * r, 0.0)
        b.cell(0.0, 1_000_000, profiler_lead_us=2_200_000 if r == 1 else 1000)
        b.cpu_op("aten::mm", 100_000, 200_000)
        out.append(b.trace())
    tl.align(out)
    for row in tl.rank_rows(out):
        assert row["wall_ms"] == pytest.approx(1000, abs=0.1), row
        assert row["idle_ms"] == pytest.approx(800, abs=0.1), row


def test_without_flight_recorder_entries_gloo_collectives_are_not_paired_by_name():
    """Nothing names a gloo worker's event without the recorder: no wait is claimed (not
    0, not a guess by order); the time is communication and the rows say so."""
    out = [gloo_straggler(r, 1e9 * r, 0.0).trace() for r in range(3)]
    for t in out:
        t.collectives = []
    tl.align(out)
    assert tl.collective_rows(out) == []
    rows = tl.rank_rows(out)
    for row in rows:
        assert row["wait_ms"] is None and row["matched"] == 0 and row["ops"] == 3, row
        assert_adds_up(row)
    assert rows[0]["communication_ms"] == pytest.approx(3 * 350, abs=1)
    assert "0 of 3" in tl.coverage(out, rows)


def test_the_verdict_names_the_straggler_its_count_and_the_others_wait(traces):
    """Rank 2 is 300 ms late at each of 3 all_reduces in a 3 s cell: 900 ms each."""
    v = tl.verdict(traces)
    assert v.text == (
        "rank 2 arrived last in 3 of 3 all_reduces; the other ranks waited 900 ms each "
        "(30 % of the cell)"
    )
    assert (v.rank, v.last, v.of) == (2, 3, 3)


def test_top_ops_are_the_ops_that_took_the_time_by_self_time():
    """aten::ones (100 ms) spends 5 ms in aten::empty and 80 ms in aten::fill_: its own
    time is 15 ms, and fill_ leads; aten::mul 40 ms."""
    b = RankBuilder(0, 0.0, 0.0)
    b.cell(0.0, 1_000_000)
    b.cpu_op("aten::ones", 100_000, 100_000)
    b.cpu_op("aten::empty", 100_000, 5_000)
    b.cpu_op("aten::fill_", 110_000, 80_000)
    b.cpu_op("aten::mul", 300_000, 40_000)
    out = [b.trace()]
    tl.align(out)
    (row,) = tl.rank_rows(out)
    assert row["top_ops"] == "aten::fill_ 57 %, aten::mul 29 %, aten::ones 11 %"
    assert row["compute_ms"] == pytest.approx(140, abs=0.01)  # nested ops count once


def test_collectives_are_numbered_from_1_within_the_cell():
    """The session's own start-up collectives took the group's seq 1-40: the cell's
    first is still number 1."""
    out = [gloo_loop(r, 5, 2000) for r in range(4)]  # seq 41-45
    tl.align(out)
    assert [c["n"] for c in tl.collective_rows(out)] == [1, 2, 3, 4, 5]


def test_a_straggler_in_one_subgroup_names_the_peer_that_waited():
    """Rank 3 is 200 ms late at each of 2 all_reduces of its pair {1, 3}; the pair {0, 2}
    arrives together: the verdict names rank 3 and its one peer, not the world."""
    out = []
    for r in range(4):
        b = RankBuilder(r, 1e6 * r, 0.0)
        b.cell(0.0, 1_000_000)
        group = "6" if r in (1, 3) else "5"
        for i in range(2):
            t0 = i * 400_000
            late = 200_000 if r == 3 else (1000 if r == 2 else 0)
            end = t0 + (210_000 if group == "6" else 11_000)
            b.gloo_collective("gloo:all_reduce", group, 7 + i, t0 + late, t0 + late, end,
                              worker=7, desc="inb_dp")  # fmt: skip
        out.append(b.trace())
        out[-1].group_ranks = {"5": [0, 2], "6": [1, 3]}
    tl.align(out)
    v = tl.verdict(out)
    assert v.text == (
        "rank 3 arrived last in 2 of 2 all_reduces; rank 1 waited 400 ms for it (40 % of its cell)"
    )
    groups = {c["group"] for c in tl.collective_rows(out)}
    assert groups == {"dp [ranks 0,2]", "dp [ranks 1,3]"}


def test_the_verdict_says_up_to_when_the_others_waited_unlike_amounts():
    """Rank 2 arrives at 500 ms, rank 0 at 0, rank 1 at 400 ms: rank 0 waited 500 ms,
    rank 1 100 ms."""
    out = []
    for r, arrive in enumerate([0, 400_000, 500_000]):
        b = RankBuilder(r, 1e6 * r, 0.0)
        b.cell(0.0, 1_000_000)
        b.gloo_collective("gloo:broadcast", "0", 3, arrive, arrive, 510_000, worker=7)
        out.append(b.trace())
    tl.align(out)
    assert tl.verdict(out).text == (
        "rank 2 arrived last in 1 of 1 broadcast; the other ranks waited for it, up to 500 ms "
        "(rank 0: 50 % of its cell)"
    )


def test_the_verdict_when_no_one_waited_or_nothing_was_matched():
    out = []
    for r in range(2):
        b = RankBuilder(r, 1e6 * r, 0.0)
        b.cell(0.0, 1_000_000)
        b.gloo_collective("gloo:all_reduce", "0", 1, 100_000 + 200 * r, 100_000 + 200 * r,
                          110_000, worker=7)  # fmt: skip
        out.append(b.trace())
    tl.align(out)
    assert tl.verdict(out).text == (
        "The ranks arrived together at the all_reduce: no rank waited more than 0.2 ms."
    )
    assert tl.verdict(out).rank is None
    for t in out:
        t.collectives = []  # gloo's ops are not named without the recorder
        t.cache.clear()
    assert "no wait is measured" in tl.verdict(out).text
    for t in out:
        t.events = [e for e in t.events if not e.get("name", "").startswith("gloo:")]
        t.cache.clear()
    assert tl.verdict(out).text.startswith("No collective or message in this cell")


# ------------------------------------------- more collectives than the recorder keeps


def gloo_loop(rank, n, late_us, ring=None, workers=(7, 8)):
    """``n`` all_reduces 10 ms apart, rank 2 ``late_us`` late at each, alternating between
    two worker threads; the recorder keeps the last ``ring`` entries."""
    b = RankBuilder(rank, 1e7 * rank, 0.0)
    b.cell(0.0, n * 10_000 + 10_000)
    for i in range(n):
        t0 = i * 10_000
        arrive = t0 + 1000 + (late_us if rank == 2 else 0)
        b.gloo_collective("gloo:all_reduce", "0", 40 + i + 1, arrive - 20, arrive,
                          t0 + 1000 + late_us + 500, worker=workers[i % 2])  # fmt: skip
    if ring is not None and ring < n:
        b.entries, b.lost = b.entries[-ring:], n - ring
    return b.trace()


def test_past_the_recorders_ring_every_collective_still_counts():
    """250 all_reduces, rank 2 2 ms late at each, a ring of 200: the 50 whose entries it
    dropped are numbered back from the first it kept, on the threads known to run them."""
    out = [gloo_loop(r, 250, 2000, ring=200) for r in range(4)]
    tl.align(out)
    rows = rows_by_rank(out)
    for r in (0, 1, 3):
        assert rows[r]["matched"] == 250, rows[r]
        assert rows[r]["wait_ms"] == pytest.approx(250 * 2, abs=0.5), rows[r]
    assert rows[2]["wait_ms"] == pytest.approx(0, abs=0.1)
    assert len(tl.collective_rows(out)) == 250
    assert all(c["last_rank"] == 2 for c in tl.collective_rows(out))


def test_past_the_ring_fast_collectives_are_not_shifted_onto_the_kept_entries():
    """Collectives 30 µs apart (one rank's gloo, seen in a real trace): an event of the
    dropped part starts well within a millisecond of the first kept entry's creation, yet
    each keeps its own number (seen: 11 left over and the rest shifted by one)."""
    b = RankBuilder(0, 5e6, 0.0)
    b.cell(0.0, 250 * 30 + 100)
    for i in range(250):
        t0 = i * 30
        b.gloo_collective("gloo:all_reduce", "0", i + 1, t0, t0 + 8, t0 + 22, worker=7 + i % 2)
    b.entries, b.lost = b.entries[-200:], 50
    t = b.trace()
    tl.align([t])
    found, _ = rank_trace.ops(t)
    assert sorted(op.keys[0][2] for op in found) == list(range(1, 251))
    by_start = sorted(found, key=lambda op: op.start)
    assert [op.keys[0][2] for op in by_start] == list(range(1, 251))


def test_past_the_ring_an_unknown_thread_leaves_the_figures_partial_and_says_so():
    """The dropped entries' events ran on a thread no kept entry names: they are left
    unmatched, the wait covers the kept ones only, and the coverage says so."""
    out = []
    for r in range(3):
        t = gloo_loop(r, 250, 2000, ring=200)
        for ev in t.events:  # the first 50 ran on a third thread, gone by the end
            if ev.get("name") == "gloo:all_reduce" and ev["ts"] - 1e7 * r < 50 * 10_000:
                ev["tid"] = 9
        out.append(t)
    tl.align(out)
    rows = rows_by_rank(out)
    assert rows[0]["matched"] == 200 and rows[0]["ops"] == 250
    assert rows[0]["wait_ms"] == pytest.approx(200 * 2, abs=0.5)
    assert_adds_up(rows[0])
    words = tl.coverage(out, list(rows.values()))
    assert "200 of 250" in words and "TORCH_FR_BUFFER_SIZE" in words


@given(
    lateness=st.lists(
        st.lists(st.integers(0, 50_000), min_size=3, max_size=3), min_size=2, max_size=5
    ),
    errors=st.lists(st.floats(-150, 150), min_size=5, max_size=5),
)
def test_each_ranks_wait_is_the_lateness_of_its_last_peer(lateness, errors):
    """Ranks arrive at each of 3 all_reduces late by known amounts, their store samples
    off by up to ±150 µs: each rank's wait is, step by step, the last arrival's lateness
    less its own (the collective ends once all are in), and the parts add up."""
    world = len(lateness)
    out = []
    for r in range(world):
        b = RankBuilder(r, 1e9 * r, 0.0, clock_err_us=errors[r])
        b.cell(0.0, 3 * 200_000)
        for step in range(3):
            t0 = step * 200_000
            arrive = t0 + 1_000 + lateness[r][step]
            last = t0 + 1_000 + max(lateness[s][step] for s in range(world))
            b.gloo_collective("gloo:all_reduce", "0", step + 1, arrive - 20, arrive, last + 500,
                              worker=7)  # fmt: skip
        out.append(b.trace())
    tl.align(out)
    rows = rows_by_rank(out)
    for r in range(world):
        truth = sum(max(lateness[s][i] for s in range(world)) - lateness[r][i] for i in range(3))
        assert rows[r]["wait_ms"] == pytest.approx(truth / 1000, abs=0.01), (r, rows[r])
        assert rows[r]["communication_ms"] == pytest.approx(1.5, abs=0.01)
        assert_adds_up(rows[r])


# ------------------------------------------------------------- overlapping collectives


def test_overlapping_collectives_wait_is_time_on_the_timeline_not_a_sum():
    """4 async all_reduces queued at once (DDP's buckets), rank 2 0.3 s late: gloo's two
    workers take two at a time, so the others wait 0.3 s once, not four times."""
    out = []
    for r in range(4):
        b = RankBuilder(r, 1e8 * r, 0.0)
        b.cell(0.0, 500_000)
        late = 300_000 if r == 2 else 0
        for i in range(4):  # the second pair waits for a worker until the first pair ends
            start, end = (late, 320_000) if i < 2 else (320_000, 340_000)
            b.gloo_collective("gloo:all_reduce", "0", i + 1, late, start, end, worker=7 + i % 2)
        out.append(b.trace())
    tl.align(out)
    rows = rows_by_rank(out)
    for r in (0, 1, 3):
        assert rows[r]["wait_ms"] == pytest.approx(300, abs=1), rows[r]
        assert rows[r]["wait_ms"] <= rows[r]["wall_ms"]
        assert_adds_up(rows[r])
    assert rows[2]["wait_ms"] == pytest.approx(0, abs=0.1)


# ---------------------------------------------------------------------------- NCCL


def nccl_rank(rank, steps=3, world=4, late_rank=2, with_seq=True, record=False):
    """A GPU rank: each step a 50 ms compute kernel, then an all_reduce whose kernel starts
    when the rank's GPU gets there (rank 2: 300 ms late, after a sleep on the CPU) and ends
    for everyone 20 ms after the last one started."""
    b = RankBuilder(rank, 3e9 * rank, 10.0 * rank)
    b.cell(0.0, steps * STEP_US)
    for step in range(steps):
        t0 = step * STEP_US
        b.cpu_op("aten::mm", t0, 30)
        b.kernel("void cutlass::Kernel2<sgemm>(Params)", t0 + 40, t0 + 50_000)
        late = LATE_US if rank == late_rank else 0
        b.nccl_collective(
            "0",
            step + 1,
            list(range(world)),
            t0 + 100 + late,
            t0 + 50_000 + late,
            t0 + 50_000 + LATE_US + 20_000,
            with_seq=with_seq,
            record=record,
        )
    return b


def test_nccl_wait_and_communication_come_from_the_gpu_kernels():
    """The record function ends at enqueue and kineto copies it onto the GPU: neither is
    the collective's time; the kernels are."""
    out = [nccl_rank(r).trace() for r in range(4)]
    tl.align(out)
    rows = rows_by_rank(out)
    for r in (0, 1, 3):
        assert rows[r]["wait_ms"] == pytest.approx(900, abs=0.1), rows[r]
        assert rows[r]["communication_ms"] == pytest.approx(60, abs=0.1), rows[r]
    assert rows[2]["wait_ms"] == pytest.approx(0, abs=0.01)
    assert rows[2]["communication_ms"] == pytest.approx(60, abs=0.1)
    for row in rows.values():
        assert row["compute_ms"] == pytest.approx(3 * 49.96, abs=0.01), row  # no NCCL kernel
        assert (row["ops"], row["matched"]) == (3, 3)
        assert "cutlass" in row["top_ops"] and "nccl" not in row["top_ops"].lower()
        assert_adds_up(row)
    coll = tl.collective_rows(out)
    assert [c["last_rank"] for c in coll] == [2, 2, 2]
    assert all(c["arrival_spread_ms"] == pytest.approx(300, abs=0.01) for c in coll)
    assert all(c["collective"] == "nccl:all_reduce" and c["group"] == "world" for c in coll)


def test_nccl_without_seq_uses_the_flight_recorder_entry_inside_the_record_function():
    """torch before 2.13 writes no "Seq" in record_param_comms (seen with 2.11): the
    entry created inside ``nccl:all_reduce`` names it."""
    out = [nccl_rank(r, with_seq=False, record=True).trace() for r in range(4)]
    tl.align(out)
    rows = rows_by_rank(out)
    assert rows[0]["matched"] == 3 and rows[0]["wait_ms"] == pytest.approx(900, abs=0.1)


def test_nccl_kernels_missing_from_the_trace_are_said_not_counted_as_idle_collectives():
    out = [nccl_rank(r).trace() for r in range(2)]
    for t in out:
        t.events = [e for e in t.events if e.get("cat") not in ("kernel", "gpu_user_annotation")
                    or "cutlass" in e.get("name", "")]  # fmt: skip
    tl.align(out)
    rows = tl.rank_rows(out)
    assert all(r["ops"] == 0 for r in rows)
    assert "6 NCCL ops had no GPU activity" in tl.coverage(out, rows)


def test_nccl_point_to_point_and_batches_pair_by_group_peer_and_order():
    """Rank 0 sends to 1 twice; rank 2 sends to 3 (unrelated), later: each send pairs with
    its own receive, never with the other pair's send."""
    ranks = [0, 1, 2, 3]
    out = []
    for r in ranks:
        b = RankBuilder(r, 1e6 * r, 0.0)
        b.cell(0.0, 1_000_000)
        for i in range(2):
            t = i * 400_000
            if r == 0:
                b.nccl_p2p("send", "0", ranks, 1, t + 100, t + 1_000, t + 101_000)
            elif r == 1:  # posts its receive 100 ms after the send
                b.nccl_p2p("recv", "0", ranks, 0, t + 100_000, t + 100_000, t + 101_000)
            elif r == 2:
                b.nccl_p2p("send", "0", ranks, 3, t + 200_000, t + 200_000, t + 250_000)
            else:  # rank 3 posts first and waits 50 ms for rank 2
                b.nccl_p2p("recv", "0", ranks, 2, t + 150_000, t + 150_000, t + 250_000)
        out.append(b.trace())
    tl.align(out)
    rows = rows_by_rank(out)
    assert rows[0]["wait_ms"] == pytest.approx(2 * 99, abs=0.1)
    assert rows[1]["wait_ms"] == pytest.approx(0, abs=0.01)
    assert rows[3]["wait_ms"] == pytest.approx(2 * 50, abs=0.1)
    assert rows[2]["wait_ms"] == pytest.approx(0, abs=0.01)
    pairs = tl.collective_rows(out)
    assert sorted((p["collective"], p["n"], p["last_rank"]) for p in pairs) == [
        ("nccl:send/recv 0->1", 1, 1), ("nccl:send/recv 0->1", 2, 1),
        ("nccl:send/recv 2->3", 1, 2), ("nccl:send/recv 2->3", 2, 2),
    ]  # fmt: skip


# ------------------------------------------------------ gloo p2p and subgroups


def test_gloo_messages_pair_by_group_peer_and_order_and_subgroups_stay_apart():
    """A p2p-only cell on gloo: 0 -> 2 in group "5", 1 -> 3 in group "6" (each pair's
    first message is seq 0), plus an all_reduce in each subgroup with the same seq: the
    pairs and the subgroups never mix, and nothing from before the cell shows."""
    out = []
    for r in range(4):
        b = RankBuilder(r, 1e6 * r, 0.0)
        b.gloo_collective("gloo:all_reduce", "0", 1, -500_000, -500_000, -400_000, worker=7)
        b.cell(0.0, 1_000_000)  # ^ the session's start-up, before the cell
        group, peer = ("5", 2 if r == 0 else 0) if r in (0, 2) else ("6", 3 if r == 1 else 1)
        op = "send" if r < 2 else "recv"
        post = {0: 100_000, 2: 150_000, 1: 300_000, 3: 200_000}[r]
        b.gloo_p2p(op, group, peer, post, 310_000 if group == "6" else 160_000, desc=f"g{group}")
        late = 200_000 if r == 3 else 0
        b.gloo_collective("gloo:all_reduce", group, 1, 500_000 + late, 500_000 + late, 720_000,
                          worker=8, desc="inb_pp")  # fmt: skip
        out.append(b.trace())
        out[-1].group_ranks = {"0": [0, 1, 2, 3], "5": [0, 2], "6": [1, 3]}
    tl.align(out)
    rows = tl.collective_rows(out)
    got = sorted((r["collective"], r["group"], r["last_rank"]) for r in rows)
    assert got == [
        ("gloo:all_reduce", "pp [ranks 0,2]", 0), ("gloo:all_reduce", "pp [ranks 1,3]", 3),
        ("gloo:send/recv 0->2", "g5 [ranks 0,2]", 2), ("gloo:send/recv 1->3", "g6 [ranks 1,3]", 1),
    ], rows  # fmt: skip
    waits = rows_by_rank(out)
    assert waits[0]["wait_ms"] == pytest.approx(50, abs=0.1)  # for rank 2's recv
    assert waits[3]["wait_ms"] == pytest.approx(100, abs=0.1)  # for rank 1's send
    assert waits[1]["wait_ms"] == pytest.approx(200, abs=0.1)  # for 3 in the all_reduce
    for row in waits.values():
        assert row["ops"] == 2 and row["matched"] == 2, row
        assert_adds_up(row)


def test_a_gloo_message_without_a_note_is_communication_not_a_guess():
    out = []
    for r in range(2):
        b = RankBuilder(r, 0.0, 0.0)
        b.cell(0.0, 100_000)
        b.gloo_p2p("send" if r == 0 else "recv", "0", 1 - r, 10_000, 60_000, note=False)
        out.append(b.trace())
    tl.align(out)
    assert tl.collective_rows(out) == []
    for row in tl.rank_rows(out):
        assert row["wait_ms"] is None and row["communication_ms"] > 49, row


# ---------------------------------------------------------------------- clock fit


@given(
    world=st.sampled_from([2, 3, 8]),
    errors=st.lists(st.floats(-200, 200), min_size=8, max_size=8),
    jitter=st.lists(st.floats(-2, 2), min_size=64, max_size=64),
)
def test_clock_fit_converges_to_the_known_offsets(world, errors, jitter):
    """Store samples off by up to ±200 µs (each within its ±200 µs), ends with ±2 µs of
    noise: after the fit every rank's clock is within a few µs of the reference's."""
    errors = errors[:world]
    ends = []
    for c in range(8):  # each collective ends at true time c ms; rank r reads it err_r off
        ends.append({r: c * 1000 + errors[r] + jitter[c * 8 + r] for r in range(world)})
    bounds = {r: 400.0 for r in range(world)}
    d = clockfit.fit(ends, bounds, reference=0)
    for r in range(world):
        assert abs(errors[r] + d[r] - errors[0]) < 5, (r, errors, d)
    assert d[0] == 0


def test_clock_fit_does_not_swap_two_ranks_it_should_bring_together():
    """Two ranks 300 µs apart: the old per-rank median moved both by the whole gap at
    once ([0, 300] -> [300, 0]); the fit keeps rank 0 and moves rank 1 onto it."""
    ends = [{0: c * 1000.0, 1: c * 1000.0 + 300} for c in range(5)]
    d = clockfit.fit(ends, {0: 400, 1: 400}, reference=0)
    assert d == {0: 0.0, 1: pytest.approx(-300, abs=1e-3)}


def test_the_collectives_never_move_a_clock_past_the_store_samples_bounds():
    out = [gloo_straggler(r, 0.0, 0.0).trace() for r in range(2)]
    for ev in out[1].events:  # rank 1's work events end 5 ms later, its clock being right
        if ev.get("name") == "gloo:all_reduce":
            ev["dur"] += 5000
    tl.align(out)
    assert out[0].refine_us == 0 and abs(out[1].refine_us) <= 400


def test_alignment_with_eight_ranks_on_two_hosts_through_the_traces():
    out = []
    for r in range(8):
        off = 0.0 if r < 4 else 2_500_000.0  # host b's wall clock 2.5 s ahead
        out.append(gloo_straggler(r, 1e9 * r, off, clock_err_us=(-1) ** r * 180.0).trace())
    tl.align(out)
    for row in tl.collective_rows(out):
        assert row["end_spread_ms"] < 0.005, row


# ------------------------------------------------------------ intervals, merge


@given(
    st.lists(st.tuples(st.floats(0, 100), st.floats(0, 30)), max_size=12),
    st.lists(st.tuples(st.floats(0, 100), st.floats(0, 30)), max_size=12),
    st.lists(st.tuples(st.floats(0, 100), st.floats(0, 30)), max_size=12),
)
def test_the_parts_of_a_window_add_up_to_it(a, b, c):
    layers = [[(s, s + d) for s, d in spans] for spans in (a, b, c)]
    parts = intervals.partition(10.0, 90.0, layers)
    assert all(p >= -1e-9 for p in parts)
    assert sum(parts) == pytest.approx(80.0)
    assert parts[0] == pytest.approx(intervals.length(intervals.clip(layers[0], 10, 90)))


def test_merged_trace_keeps_thread_names_and_numbers_flows_per_rank():
    out = [nccl_rank(r, world=2, late_rank=1).trace() for r in range(2)]
    tl.align(out)
    merged = json.loads(json.dumps(trace_merge.merged(out, {0: "a", 1: "b"})))
    events = merged["traceEvents"]
    names = [e["args"]["name"] for e in events if e.get("name") == "process_name"]
    assert names == ["rank 0 (a)", "rank 1 (b)"]
    threads = {(e["pid"], e["tid"]) for e in events if e.get("name") == "thread_name"}
    assert threads == {(0, MAIN), (1, MAIN)}
    flows: dict[int, set] = {}
    for e in events:
        if e.get("ph") in ("s", "f"):
            flows.setdefault(e["id"], set()).add(e["pid"])
    assert flows and all(len(pids) == 1 for pids in flows.values())  # no arrow joins ranks
    assert min(e["ts"] for e in events if e.get("ph") == "X") == 0
    last: dict[int, float] = {}  # each rank's last NCCL kernel's end: one moment
    for e in events:
        if e.get("cat") == "kernel" and e["name"].startswith("ncclDevKernel"):
            last[e["pid"]] = max(last.get(e["pid"], 0), e["ts"] + e["dur"])
    assert sorted(last) == [0, 1] and abs(last[0] - last[1]) < 1


def test_the_streamed_merge_is_the_one_in_memory():
    """What %%dist_profile writes (each rank shifts its own events and sends a fragment;
    the kernel streams the fragments in) is the trace ``merged`` builds in memory."""
    import io

    out = [nccl_rank(r, world=2, late_rank=1).trace() for r in range(2)]
    tl.align(out)
    zero, bases = trace_merge.zero_us(out), trace_merge.flow_bases(out)
    pieces = {
        t.rank: trace_merge.fragment(
            trace_merge.shift(
                json.loads(json.dumps(t.events)), t.rank, t.shift_us - zero, bases[t.rank]
            )  # fmt: skip
        )
        for t in out
    }
    f = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    chunks = {r: [p[: len(p) // 2], b"", p[len(p) // 2 :].encode()] for r, p in pieces.items()}
    trace_merge.write(f, out, {0: "a"}, lambda r: chunks[r], zero)
    f.flush()
    written = json.loads(f.buffer.getvalue())
    assert written == json.loads(json.dumps(trace_merge.merged(out, {0: "a"})))
