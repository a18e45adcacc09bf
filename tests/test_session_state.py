"""What the session says of itself after a failure (issue 33, items 1 and 2), in a real kernel
on 4 CPU ranks: a session whose groups are not whole refuses what needs them in one line
naming the fix; %dist_status tells failed, released and idle-after-a-rebuild apart, under a
session line."""

from __future__ import annotations

import pytest
from conftest import message, text_of, use_session

pytestmark = pytest.mark.timeout(600)

FLAGS = "--nprocs 4 --timeout 5"

TIMES_OUT = """%%dist
import time
if rank == 0:
    dist.barrier()  # the others are busy for longer than the 5 s collective timeout
else:
    time.sleep(8)
"""


def test_a_timed_out_collective_refuses_what_needs_the_groups_until_a_restart(kernel):
    use_session(kernel, FLAGS)
    failed = text_of(kernel.run(TIMES_OUT, allow_error=True, timeout=120), "error")
    assert "timed out" in failed, failed
    status = text_of(kernel.run("%dist_status"))
    assert "session needs %dist_restart: a collective timed out" in status, status
    refused = {
        "%%dist": kernel.run("%%dist\nprint(rank)", allow_error=True),
        "pull": kernel.run("%dist_pull rank", allow_error=True),
        "bench": kernel.run("%dist_bench all_reduce --sizes 1K --iters 1", allow_error=True),
    }
    for what, cell in refused.items():
        err = text_of(cell, "error")
        assert message(cell) == (
            "The process groups are not whole: a collective timed out. Run %dist_restart first."
        ), (what, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) <= 2, (what, err)
    kernel.run("%dist_restart", timeout=120)
    assert "ready" in text_of(kernel.run("%dist_status"))
    assert "[rank 3] 3" in text_of(kernel.run("%%dist\nprint(rank)"))


RAISES_WHILE_OTHERS_WAIT = """%%dist
import time
x = torch.ones(1)
if rank == 1:
    time.sleep(1)
    raise ValueError("rank 1 bails out")
dist.all_reduce(x)
"""


def test_status_after_a_failure_the_rebuild_fixed_says_idle_with_a_note(kernel):
    use_session(kernel, FLAGS)
    kernel.run("%%dist\nkeep = rank", timeout=60)
    cell = kernel.run(RAISES_WHILE_OTHERS_WAIT, allow_error=True, timeout=120)
    err = text_of(cell, "error")  # the wait is named by the notebook's cell number (item 3)
    assert f"In[{cell.execution_count}], line 7" in err, err  # the editor's line
    rows = text_of(
        kernel.run("for r in dist_session.status(): print(r.rank, r.state, '|', r.note)")
    ).splitlines()
    assert rows[1] == "1 idle | last cell failed: ValueError: rank 1 bails out", rows
    for r in (0, 2, 3):
        assert rows[r].startswith(f"{r} idle | last cell released (was waiting for rank 1"), rows
    line = text_of(kernel.run("print(dist_session.session_line())")).strip()
    assert line == "rebuilt after a failure on rank 1, variables kept"
    status = text_of(kernel.run("%dist_status"))
    assert "session rebuilt after a failure on rank 1, variables kept · 4 ranks: 4 idle" in status
    assert "[rank 2] 2" in text_of(kernel.run("%%dist\nprint(keep)"))  # variables kept
    assert "session ready" in text_of(kernel.run("%dist_status"))


def test_a_failed_pull_says_one_line_per_rank_and_keeps_the_tracebacks_in_a_file(kernel):
    use_session(kernel, FLAGS)
    kernel.run("%%dist\nclass Unpicklable:\n    def __reduce__(self):\n"
               "        raise TypeError('cannot send me')\nodd = Unpicklable()")  # fmt: skip
    err = text_of(kernel.run("%dist_pull odd", allow_error=True), "error")
    assert "[rank 0] TypeError: cannot send me" in err, err
    assert "ipyparallel" not in err and "infini_notebook/" not in err, err
    log = err.split("(the tracebacks: ")[1].split(")")[0]
    with open(log, encoding="utf-8") as f:
        assert "cannot send me" in f.read()
