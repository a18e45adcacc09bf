"""%%dist_profile (issues 31 and 39): one timeline for all ranks, its figures checked
against what the ranks were made to do. In a real kernel on 4 CPU ranks (gloo, tp 2 x dp 2,
one session for the module): a rank that sleeps before each collective arrives last and
the others wait for it; more collectives than the Flight Recorder keeps; collectives that
overlap; messages and subgroups; a rank whose profiler starts long before its cell; a
start that fails on one rank, and a torch.profiler of the user's already running."""

from __future__ import annotations

import json
import os
import re
import statistics

import pytest
from conftest import text_of, use_session

pytestmark = pytest.mark.timeout(600)

STEPS = 4
LOOP = f"""import time
for step in range({STEPS}):
    x = torch.ones(1000) * rank
    if rank == 2:
        time.sleep(0.3)
    dist.all_reduce(x)
print('done', rank)"""


def profile_tables(kernel, code: str, out) -> dict:
    """``code`` profiled through the API: its tables as records, its files and coverage."""
    run = (
        f"import json\n_p = dist_session.profile({code!r}, out={str(out)!r}, echo=False)\n"
        "print(json.dumps({'ranks': _p.ranks.to_dict('records'),"
        " 'collectives': _p.collectives.to_dict('records'), 'files': _p.files,"
        " 'coverage': _p.coverage, 'verdict': _p.verdict, 'straggler': _p.straggler},"
        " default=str))"
    )
    text = text_of(kernel.run(run, timeout=240))
    return json.loads(text.replace("NaN", "null"))


def by_rank(tables) -> dict[int, dict]:
    return {r["rank"]: r for r in tables["ranks"]}


def assert_adds_up(row):
    parts = [row["compute_ms"], row["communication_ms"], row["wait_ms"] or 0, row["idle_ms"]]
    assert min(parts) >= 0 and sum(parts) == pytest.approx(row["wall_ms"], abs=0.01), row


def profiling_now(kernel) -> str:
    """Which ranks have a torch.profiler on, as the cell thread sees it."""
    return text_of(
        kernel.run(
            "%%dist\nprint('profiling', bool(torch.autograd.profiler._is_profiler_enabled"
            " or torch._C._autograd._profiler_enabled()))"
        )
    )


@pytest.fixture(scope="module")
def profiled(kernel, tmp_path_factory):
    """The straggler loop profiled through the API: its tables as records, its folder."""
    use_session(kernel, "--nprocs 4 --tp 2")
    out = tmp_path_factory.mktemp("profile")
    return profile_tables(kernel, LOOP, out), out


def test_the_straggler_arrives_last_at_every_step_and_the_others_wait(profiled):
    tables, _ = profiled
    steps = [c for c in tables["collectives"] if c["group"] == "world"]
    assert len(steps) == STEPS and all(c["last_rank"] == 2 for c in steps), steps
    for c in steps:
        assert 240 <= c["arrival_spread_ms"] <= 360, c  # 0.3 s +- 20 %
        assert 3 * 240 <= c["wait_caused_ms"] <= 3 * 360, c  # three ranks waited
    ranks = by_rank(tables)
    for r in (0, 1, 3):
        assert STEPS * 240 <= ranks[r]["wait_ms"] <= STEPS * 360, ranks[r]
    assert ranks[2]["wait_ms"] < 50 and ranks[2]["idle_ms"] > STEPS * 280, ranks[2]
    for row in ranks.values():  # the cell's collectives only, each matched on every member
        assert row["ops"] == row["matched"] == STEPS, row
        assert_adds_up(row)


VERDICT = re.compile(
    r"rank 2 arrived last in 4 of 4 all_reduces; the other ranks waited "
    r"(?P<wait>[\d.]+) (?P<unit>s|ms) each \((?P<share>\d+) % of the cell\)"
)


def test_the_verdict_names_the_straggler_and_the_wait_its_sleeps_caused(profiled):
    """The one sentence a user reads first, checked against what rank 2 was made to do:
    4 sleeps of 0.3 s, each before an all_reduce of the world group."""
    tables, _ = profiled
    found = VERDICT.fullmatch(tables["verdict"])
    assert found, tables["verdict"]
    wait_s = float(found["wait"]) / (1 if found["unit"] == "s" else 1000)
    assert STEPS * 0.24 <= wait_s <= STEPS * 0.36, tables["verdict"]  # 0.3 s +- 20 %
    others = [r for r in tables["ranks"] if r["rank"] != 2]
    share = sum(r["wait_ms"] for r in others) / sum(r["wall_ms"] for r in others)
    assert abs(int(found["share"]) - 100 * share) <= 2, (tables["verdict"], share)
    assert tables["straggler"] == [2, STEPS, STEPS]


CHAIN = """import time
for step in range(3):
    t = torch.ones(1000)
    if rank == 0:
        time.sleep(0.3)
        dist.send(t, 1)
    else:
        dist.recv(t, rank - 1)
        if rank < 3:
            dist.send(t, rank + 1)"""


def test_in_a_chain_of_messages_the_verdict_names_the_first_rank_not_the_last_sender(
    kernel, profiled
):
    """Issue 50: 0 -> 1 -> 2 -> 3 with rank 0 sleeping 0.3 s before each send was "rank 2
    arrived last in 3 of 6 messages; rank 3 waited 604 ms for it". Each later rank waits
    for rank 0's 3 sleeps, passed along the chain."""
    _, out = profiled
    tables = profile_tables(kernel, CHAIN, out / "chain")
    verdict = tables["verdict"]
    assert verdict.startswith(
        "rank 0 is where the delay starts: it arrived last in 3 of 3 messages; the other ranks"
    ), verdict
    assert verdict.endswith("rank 2 through rank 1, rank 3 through ranks 1 and 2"), verdict
    ranks = by_rank(tables)
    assert [ranks[r]["waited_for"] for r in range(4)] == [
        "", "rank 0", "rank 0 through rank 1", "rank 0 through ranks 1 and 2"
    ]  # fmt: skip
    for r in (1, 2, 3):
        assert 3 * 240 <= ranks[r]["wait_ms"] <= 3 * 360 + 100, ranks[r]  # 3 x 0.3 s


def test_collectives_are_numbered_in_the_cell_and_ops_ranked_by_self_time(profiled):
    """The session's start-up all_reduces took the world group's first numbers: the cell's
    are 1-4 all the same; each rank's top ops carry their share of its compute time."""
    tables, _ = profiled
    world = sorted(c["n"] for c in tables["collectives"] if c["group"] == "world")
    assert world == list(range(1, STEPS + 1)), tables["collectives"]
    for row in tables["ranks"]:
        shares = re.findall(r"(\S+) (\d+) %", row["top_ops"])
        assert shares and sum(int(p) for _, p in shares) <= 101, row["top_ops"]
        assert [int(p) for _, p in shares] == sorted((int(p) for _, p in shares), reverse=True)


def test_the_merged_trace_has_a_track_per_rank_on_one_clock(profiled):
    tables, out = profiled
    merged = json.load(open(out / "merged.json"))
    tracks = [e["args"]["name"] for e in merged["traceEvents"] if e.get("name") == "process_name"]
    assert [t.split(" (")[0] for t in tracks] == [f"rank {r}" for r in range(4)]
    ends: dict[int, list[float]] = {}
    for e in merged["traceEvents"]:
        if e.get("name") == "gloo:all_reduce" and e.get("ph") == "X":
            ends.setdefault(e["pid"], []).append(e["ts"] + e["dur"])
    assert sorted(ends) == [0, 1, 2, 3] and {len(v) for v in ends.values()} == {STEPS}
    ends = {r: sorted(v) for r, v in ends.items()}
    # Each rank's clock error: its distance from the others' ends. A wrong clock puts a rank
    # off by the same amount at every step; gloo's worker threads, waking late on loaded
    # cores, put an end ms off at some steps only (2 of 4 steps 5-6 ms off with three test
    # workers on 2 cores, 2026-11-28). So the closest step is the clock's error bound.
    for r in range(4):
        gaps = [
            abs(ends[r][i] - statistics.median(ends[o][i] for o in range(4))) for i in range(STEPS)
        ]
        assert min(gaps) < 2000, (r, gaps)  # µs
    for r in range(4):  # each rank's own trace, with what HTA reads
        own = json.load(open(tables["files"][str(r)]))
        assert own["distributedInfo"]["rank"] == r
    threads = {(e["pid"], e["args"]["name"].split(" (")[-1]) for e in merged["traceEvents"]
               if e.get("name") == "thread_name"}  # fmt: skip
    assert {(r, "ipengine)") for r in range(4)} <= threads, threads  # each rank's threads


def test_past_the_flight_recorders_ring_every_collective_is_still_measured(kernel, profiled):
    """250 all_reduces, rank 2 2 ms late at each, a ring of 200 entries: every one is
    matched, and the others' wait is the 250 x 2 ms they spent (was 0 on every rank)."""
    _, out = profiled
    code = (
        "import time\nx = torch.ones(10)\nfor _ in range(250):\n    if rank == 2:\n"
        "        time.sleep(0.002)\n    dist.all_reduce(x)"
    )
    tables = profile_tables(kernel, code, out / "ring")
    ranks = by_rank(tables)
    for r in (0, 1, 3):
        assert ranks[r]["ops"] == ranks[r]["matched"] == 250, ranks[r]
        assert 250 * 1.6 <= ranks[r]["wait_ms"] <= ranks[r]["wall_ms"], ranks[r]
        assert_adds_up(ranks[r])
    assert ranks[2]["wait_ms"] < 0.3 * min(ranks[r]["wait_ms"] for r in (0, 1, 3)), ranks[2]
    assert len(tables["collectives"]) == 250
    assert "TORCH_FR_BUFFER_SIZE" in tables["coverage"], tables["coverage"]


def test_overlapping_collectives_wait_is_time_not_a_sum(kernel, profiled):
    """4 async all_reduces at once (DDP's buckets), rank 2 0.3 s late: the others wait
    0.3 s once (it was summed per collective: 620 ms of wait in a 391 ms cell)."""
    _, out = profiled
    code = (
        "import time\nif rank == 2:\n    time.sleep(0.3)\n"
        "works = [dist.all_reduce(torch.ones(1000), async_op=True) for _ in range(4)]\n"
        "for w in works:\n    w.wait()"
    )
    ranks = by_rank(profile_tables(kernel, code, out / "async"))
    for r in (0, 1, 3):
        assert 240 <= ranks[r]["wait_ms"] <= 420, ranks[r]
        assert ranks[r]["wait_ms"] <= ranks[r]["wall_ms"] and ranks[r]["matched"] == 4
        assert_adds_up(ranks[r])
    assert ranks[2]["wait_ms"] < 50, ranks[2]


def test_messages_pair_by_group_peer_and_order_and_only_the_cells_show(kernel, profiled):
    """A p2p-only cell: 0 -> 1 (rank 1 posts its receive 0.2 s late) and 2 -> 3 (rank 2
    sends 0.1 s late). Rank 0's send never pairs with rank 2's, and the session's start-up
    all_reduces are not reported as the cell's."""
    _, out = profiled
    code = (
        "import time\nt = torch.ones(10)\nif rank == 0:\n    dist.send(t, 1)\n"
        "elif rank == 1:\n    time.sleep(0.2)\n    dist.recv(t, 0)\n"
        "elif rank == 2:\n    time.sleep(0.1)\n    dist.send(t, 3)\nelse:\n    dist.recv(t, 2)"
    )
    tables = profile_tables(kernel, code, out / "p2p")
    got = sorted((c["collective"], c["last_rank"]) for c in tables["collectives"])
    assert got == [("gloo:send/recv 0->1", 1), ("gloo:send/recv 2->3", 2)], tables
    ranks = by_rank(tables)
    assert 70 <= ranks[3]["wait_ms"] <= 160, ranks[3]  # rank 3 waited for rank 2's send
    assert ranks[0]["wait_ms"] <= 260 and ranks[1]["wait_ms"] < 30, ranks
    for row in ranks.values():
        assert row["ops"] == row["matched"] == 1, row  # its message, seen on both ends
        assert_adds_up(row)
    after = text_of(kernel.run(f"%%dist\n{code}\nprint('sent', rank)", allow_error=True))
    assert all(f"[rank {r}] sent {r}" in after for r in range(4)), after  # send/recv restored


def test_subgroups_stay_apart(kernel, profiled):
    """An all_reduce in each tp group ({0,1}, {2,3}; rank 3 0.2 s late), then one in each dp
    group ({0,2}, {1,3}; rank 0 0.1 s late): four collectives, each with its own last."""
    _, out = profiled
    code = (
        "import time\nif rank == 3:\n    time.sleep(0.2)\n"
        "dist.all_reduce(torch.ones(4), group=groups.tp)\n"
        "if rank == 0:\n    time.sleep(0.1)\ndist.all_reduce(torch.ones(4), group=groups.dp)"
    )
    tables = profile_tables(kernel, code, out / "groups")
    rows = tables["collectives"]
    assert len(rows) == 4 and all(c["n"] == 1 for c in rows), rows
    groups = {(c["group"], c["ranks"]) for c in rows}  # four groups, none mixed, named as
    assert groups == {  # errors name them; "ranks" lists the members (was a count, 2)
        ("tp [ranks 0-1]", "0-1"), ("tp [ranks 2-3]", "2-3"),
        ("dp [ranks 0,2]", "0,2"), ("dp [ranks 1,3]", "1,3"),
    }  # fmt: skip
    # rank 0 waited for rank 2, which was still waiting for rank 3: the delay started at 3
    assert tables["verdict"].startswith(
        "rank 3 is where the delay starts: it arrived last in 2 of 2 all_reduces; the other"
    ), tables["verdict"]
    assert tables["verdict"].endswith("rank 0 through rank 2"), tables["verdict"]
    ranks = by_rank(tables)
    assert [ranks[r]["waited_for"] for r in range(4)] == [
        "rank 3 through rank 2", "rank 3", "rank 3", ""
    ]  # fmt: skip
    assert 140 <= ranks[1]["wait_ms"] <= 280, ranks[1]  # dp {1,3}: for rank 3
    assert 140 <= ranks[2]["wait_ms"] <= 280, ranks[2]  # tp {2,3}: for rank 3
    assert 50 <= ranks[0]["wait_ms"] <= 180, ranks[0]  # dp {0,2}: for rank 2 (0.2 - 0.1)
    assert ranks[3]["wait_ms"] < 40, ranks[3]


def test_the_window_is_the_cell_not_the_profilers_start(kernel, profiled):
    """Rank 1's profiler runs 1 s before its cell starts (as under load, when the ranks'
    profilers started up to 2.2 s apart): every rank's wall is its 0.5 s cell alone."""
    _, out = profiled
    kernel.run(
        "%%dist --ranks 1\nimport time as _t\nfrom infini_notebook.engine import profiling as _pm\n"
        "_orig = _pm._distributed\ndef _late():\n    if 'prof' in _pm._state:\n"
        "        _pm._distributed = _orig\n        _t.sleep(1.0)\n    return _orig()\n"
        "_pm._distributed = _late"
    )
    ranks = by_rank(profile_tables(kernel, "import time\ntime.sleep(0.5)", out / "window"))
    for row in ranks.values():
        assert 450 <= row["wall_ms"] <= 800, row  # was 1.5 s on the ranks that waited
        assert_adds_up(row)


def test_a_failed_start_on_one_rank_stops_every_profiler(kernel, profiled):
    _, out = profiled
    kernel.run(
        "%%dist --ranks 2\nfrom infini_notebook.engine import profiling as _pm\n"
        "_orig = _pm._distributed\ndef _broken():\n    if 'prof' in _pm._state:\n"
        "        _pm._distributed = _orig\n        raise OSError('injected')\n    return _orig()\n"
        "_pm._distributed = _broken"
    )
    cell = kernel.run(f"%%dist_profile --out {out / 'failed-start'}\nx = 1", allow_error=True)
    err = text_of(cell, "error")
    assert "could not start the profiler on rank 2" in err and "injected" in err, err
    assert profiling_now(kernel).count("profiling False") == 4
    assert not os.path.exists(out / "failed-start")


def test_a_running_torch_profiler_of_the_users_is_refused_and_left_running(kernel, profiled):
    _, out = profiled
    kernel.run("%%dist --ranks 1\n_mine = torch.profiler.profile()\n_mine.start()")
    try:
        cell = kernel.run(f"%%dist_profile --out {out / 'theirs'}\nx = 1", allow_error=True)
        err = text_of(cell, "error")
        assert "refused" in err and "rank 1" in err and "of your own" in err, err
        assert len([line for line in err.splitlines() if "refused" in line]) == 1
        states = profiling_now(kernel)
        assert "[rank 1] profiling True" in states and states.count("profiling False") == 3
    finally:
        kernel.run("%%dist --ranks 1\n_mine.stop()")


def test_the_magic_shows_the_cell_output_the_verdict_the_figure_and_the_files(kernel, profiled):
    """With no --out, the traces go to dist_profile/In<N>-<time>/: no brackets, so the
    folder needs no quoting in a shell."""
    _, out = profiled
    here = out / "magic"
    here.mkdir()
    kernel.run(f"import os as _os\n_cwd = _os.getcwd()\n_os.chdir({str(here)!r})")
    try:
        cell = kernel.run(f"%%dist_profile\n{LOOP}", timeout=180)
    finally:
        kernel.run("_os.chdir(_cwd)")
    text = text_of(cell)
    assert all(f"[rank {r}] done {r}" in text for r in range(4))
    (shown,) = [o["data"] for o in cell.outputs if "text/html" in o.get("data", {})]
    assert VERDICT.fullmatch(shown["text/plain"].splitlines()[0]), shown["text/plain"][:300]
    html = shown["text/html"]
    assert html.startswith('<p class="infini-verdict"><b>rank 2 arrived last in 4 of 4')
    assert "<svg" in html and "wait for the last peer" in html and "arrived last 4/4" in html
    assert '<a href="https://ui.perfetto.dev"' in html
    (folder,) = os.listdir(here / "dist_profile")
    assert re.fullmatch(r"In\d+-\d{8}-\d{6}", folder), folder
    assert f"dist_profile/{folder}/: merged.json" in html
    assert sorted(os.listdir(here / "dist_profile" / folder)) == ["merged.json"] + [
        f"rank{r}.json" for r in range(4)
    ]


def test_a_failing_rank_still_yields_the_others_traces(kernel, profiled):
    _, out = profiled
    code = (
        "from infini_notebook import DistCellError\ntry:\n"
        "    dist_session.profile('x = torch.ones(1)\\nif rank == 1:\\n    raise ValueError(1)',"
        f" out={str(out / 'failed')!r}, echo=False)\n"
        "except DistCellError as e:\n"
        "    print('partial', e.profile.partial, sorted(e.profile.files))"
    )
    assert "partial [1] [0, 1, 2, 3]" in text_of(kernel.run(code, timeout=180))
    assert "[rank 3] 3" in text_of(kernel.run("%%dist\nprint(rank)"))
    # the magic says where the traces are above the error, in lines that JupyterLab need
    # not break (it breaks a long one anywhere, mid-word)
    cell = kernel.run(
        f"%%dist_profile --out {out / 'failed-magic'}\nx = torch.ones(1)\n"
        "if rank == 1:\n    raise ValueError(1)\ndist.all_reduce(x)",
        allow_error=True,
        timeout=180,
    )
    said = text_of(cell, "stdout")
    assert "partial (the cell failed) on" in " ".join(said.split()), said
    assert "https://ui.perfetto.dev" in said and "Note: wait is measured" in said, said
    assert max(len(line) for line in said.splitlines()) <= 100, said


def test_a_trace_over_the_limit_is_refused_and_the_ranks_stop_profiling(kernel, profiled):
    _, out = profiled
    cell = kernel.run(
        f"%%dist_profile --max-mb 0.0001 --out {out / 'big'}\nx = 1", allow_error=True
    )
    err = text_of(cell, "error")
    assert "over the 0.0001 MB limit" in err and "--max-mb" in err, err
    assert not os.path.exists(out / "big")
    assert "[rank 0] 0" in text_of(kernel.run("%%dist\nprint(rank)"))
