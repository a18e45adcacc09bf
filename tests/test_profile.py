"""%%dist_profile (issue 31): one timeline for all ranks. In a real kernel on 4 CPU ranks
(gloo): rank 2 sleeps 0.3 s before each all_reduce, so it arrives last every time and the
others wait for it; the merged trace has a track per rank on one clock."""

from __future__ import annotations

import json
import os
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


@pytest.fixture(scope="module")
def profiled(kernel, tmp_path_factory):
    """The straggler loop profiled through the API: its tables as records, its folder."""
    use_session(kernel, "--nprocs 4 --tp 2")
    out = tmp_path_factory.mktemp("profile")
    code = (
        f"import json\n_p = dist_session.profile({LOOP!r}, out={str(out)!r}, echo=False)\n"
        "print(json.dumps({'ranks': _p.ranks.to_dict('records'),"
        " 'collectives': _p.collectives.to_dict('records'), 'files': _p.files}))"
    )
    return json.loads(text_of(kernel.run(code, timeout=180))), out


def test_the_straggler_arrives_last_at_every_step_and_the_others_wait(profiled):
    tables, _ = profiled
    steps = [c for c in tables["collectives"] if c["group"] == "default_pg"]
    assert len(steps) == STEPS and all(c["last_rank"] == 2 for c in steps), steps
    for c in steps:
        assert 240 <= c["arrival_spread_ms"] <= 360, c  # 0.3 s +- 20 %
        assert 3 * 240 <= c["wait_caused_ms"] <= 3 * 360, c  # three ranks waited
    ranks = {r["rank"]: r for r in tables["ranks"]}
    for r in (0, 1, 3):
        assert STEPS * 240 <= ranks[r]["wait_ms"] <= STEPS * 360, ranks[r]
    assert ranks[2]["wait_ms"] < 50 and ranks[2]["idle_ms"] > STEPS * 280, ranks[2]


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
    # Each rank's clock error: its median distance from the others' ends, over the steps.
    # (One event may end ms apart: gloo's worker threads wake late on 2 loaded cores.)
    for r in range(4):
        gaps = [
            abs(ends[r][i] - statistics.median(ends[o][i] for o in range(4))) for i in range(STEPS)
        ]
        assert statistics.median(gaps) < 2000, (r, gaps)  # µs
    for r in range(4):  # each rank's own trace, with what HTA reads
        own = json.load(open(tables["files"][str(r)]))
        assert own["distributedInfo"]["rank"] == r


def test_the_magic_shows_the_cell_output_the_figure_and_where_the_files_are(kernel, profiled):
    _, out = profiled
    cell = kernel.run(f"%%dist_profile --out {out / 'magic'}\n{LOOP}", timeout=180)
    text = text_of(cell)
    assert all(f"[rank {r}] done {r}" in text for r in range(4))
    html = "".join(o.get("data", {}).get("text/html", "") for o in cell.outputs)
    assert "<svg" in html and "wait for the last peer" in html and "merged.json" in html
    assert sorted(os.listdir(out / "magic")) == ["merged.json"] + [
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


def test_a_trace_over_the_limit_is_refused_and_the_ranks_stop_profiling(kernel, profiled):
    _, out = profiled
    cell = kernel.run(
        f"%%dist_profile --max-mb 0.0001 --out {out / 'big'}\nx = 1", allow_error=True
    )
    err = text_of(cell, "error")
    assert "over the 0.0001 MB limit" in err and "--max-mb" in err, err
    assert not os.path.exists(out / "big")
    assert "[rank 0] 0" in text_of(kernel.run("%%dist\nprint(rank)"))
