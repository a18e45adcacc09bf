"""The merged timeline's arithmetic (issue 31) on synthetic traces with known clocks: three
ranks whose trace clocks and wall clocks are off by known amounts, rank 2 arriving 300 ms
late at each all_reduce."""

from __future__ import annotations

import json

import pytest

from infini_notebook.core import timeline as tl

STEP_US = 1_000_000  # true time between steps
LATE_US = 300_000


def synthetic(rank, trace_base_us, wall_off_us, rtt_us: float = 400, read_at_us=None):
    """A rank's trace over 3 steps: a 50 ms op, then an all_reduce it enters at 100 ms (rank
    2 at 400 ms) and that ends for everyone at 450 ms (true time, µs)."""
    events, entries = [], []

    def at(true_us: float) -> float:
        return true_us + trace_base_us  # the trace's own clock

    marks = {}
    for name, true in ((tl.START_MARK, 0.0), (tl.STOP_MARK, 3 * STEP_US)):
        events.append(
            {"ph": "X", "name": name, "ts": at(true), "dur": 2, "tid": 1, "cat": "user_annotation"}
        )
        marks[name] = int((true + 1 + wall_off_us) * 1000)  # read inside the marker
    for step in range(3):
        t0 = step * STEP_US
        events.append(
            {"ph": "X", "name": "aten::mm", "ts": at(t0), "dur": 50_000, "tid": 1, "cat": "cpu_op"}
        )
        arrive = t0 + 100_000 + (LATE_US if rank == 2 else 0)
        end = t0 + 450_000
        events.append(
            {"ph": "X", "name": "gloo:all_reduce", "ts": at(arrive), "dur": end - arrive, "tid": 7}
        )
        entries.append(
            {
                "profiling_name": "gloo:all_reduce",
                "process_group": ["0", "default_pg"],
                "collective_seq_id": step + 1,
                "time_created_ns": int((arrive + wall_off_us) * 1000),
            }
        )
    kernel_before = 5 * STEP_US  # the store sample: the rank read its clock mid-trip
    sample = (
        int(kernel_before * 1000),
        int((kernel_before + rtt_us / 2 + wall_off_us) * 1000),
        int((kernel_before + rtt_us) * 1000),
    )
    trace = tl.RankTrace(rank, events, marks, entries, tl.best_sample([sample]))
    return trace


@pytest.fixture
def traces():
    # trace clocks days apart, wall clocks off by up to 0.15 ms; rank 1 read its clock early
    # in the store's round trip, so the sample alone leaves it 150 µs off: the collectives
    # correct that
    out = [
        synthetic(0, 4e12, 0.0),
        synthetic(1, 7e9, 150.0, read_at_us=50),
        synthetic(2, -3e6, -120.0),
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


def test_per_rank_accounting(traces):
    rows = {r["rank"]: r for r in tl.rank_rows(traces)}
    for r in (0, 1):
        assert rows[r]["wait_ms"] == pytest.approx(900, abs=1)  # 3 steps x 300 ms
        assert rows[r]["communication_ms"] == pytest.approx(150, abs=1)  # 3 x 50 ms
    assert rows[2]["wait_ms"] == pytest.approx(0, abs=0.5)
    assert rows[2]["idle_ms"] == pytest.approx(rows[0]["idle_ms"] + 900, abs=1)
    for row in rows.values():
        assert row["wall_ms"] == pytest.approx(3000, abs=0.1)
        assert row["compute_ms"] == pytest.approx(150, abs=0.1)
        assert row["top_ops"] == "aten::mm"


def test_merged_trace_has_a_track_per_rank_from_time_zero(traces):
    merged = json.loads(json.dumps(tl.merged(traces, {0: "a", 1: "a", 2: "b"})))
    names = [e["args"]["name"] for e in merged["traceEvents"] if e.get("name") == "process_name"]
    assert names == ["rank 0 (a)", "rank 1 (a)", "rank 2 (b)"]
    starts = [e["ts"] for e in merged["traceEvents"] if e.get("ph") == "X"]
    assert min(starts) == 0
    ends = {
        e["pid"]: e["ts"] + e["dur"]
        for e in merged["traceEvents"]
        if e.get("name") == "gloo:all_reduce"
    }
    assert max(ends.values()) - min(ends.values()) < 10  # the last step's ends, µs


def test_the_collectives_never_move_a_clock_past_the_store_samples_bounds():
    a, b = synthetic(0, 0.0, 0.0, rtt_us=400), synthetic(1, 0.0, 0.0, rtt_us=400)
    for ev in b.events:  # rank 1's work events end 5 ms later, its clock being right
        if ev["name"] == "gloo:all_reduce":
            ev["dur"] += 5000
    tl.align([a, b])
    assert abs(b.refine_us) <= 200 and abs(a.refine_us) <= 200


def test_without_the_flight_recorder_the_trace_events_still_tell_who_was_late():
    out = [synthetic(r, 1e9 * r, 0.0) for r in range(3)]
    for t in out:
        t.collectives = []
    tl.align(out)
    rows = tl.collective_rows(out)
    assert len(rows) == 3 and all(r["last_rank"] == 2 for r in rows), rows
    waits = {r["rank"]: r["wait_ms"] for r in tl.rank_rows(out)}
    assert waits[0] == pytest.approx(900, abs=1) and waits[2] == pytest.approx(0, abs=0.5)
