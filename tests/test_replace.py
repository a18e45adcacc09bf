"""A failed rank costs only that rank (issue 51): `%dist_restart --ranks N` starts new
engines for those ranks only; every other rank keeps its process and variables, and every
rank's process groups, `groups` and `mesh` are made anew. In a real kernel on 4 CPU ranks
(tp 2 x dp 2), one session for the module: ranks ended by os._exit mid-cell, SIGKILL while
idle, SIGSEGV mid-cell, two at once; the groups afterwards checked against the layout
computed here independently."""

from __future__ import annotations

import ast
import os
import signal

import pytest
from conftest import message, text_of, use_session

pytestmark = pytest.mark.timeout(300)

SESSION = "--nprocs 4 --tp 2 --timeout 10"
# tp is the fastest-moving dimension: ranks (dp, tp) = arange(4).view(2, 2)
TP, DP = [[0, 1], [2, 3]], [[0, 2], [1, 3]]

CHECK = """%%dist
import os
y = torch.ones(1); dist.all_reduce(y)
t = torch.ones(1); dist.all_reduce(t, group=groups.tp)
print(repr((os.getpid(), 'keep' in globals() and keep, y.item(), t.item(),
            dist.get_process_group_ranks(groups.tp), dist.get_process_group_ranks(groups.dp),
            mesh['tp'].mesh.tolist(), mesh['dp'].mesh.tolist())))"""


@pytest.fixture(scope="module")
def four(kernel):
    use_session(kernel, SESSION)
    return kernel


def fresh_start(kernel) -> dict[int, tuple]:
    """Every rank with ``keep`` set, and what CHECK says of each."""
    kernel.run("%%dist\nkeep = rank * 100")
    return check(kernel)


def check(kernel) -> dict[int, tuple]:
    out = text_of(kernel.run(CHECK))
    rows = {}
    for line in out.splitlines():
        label, _, rest = line.partition("] ")
        rows[int(label.removeprefix("[rank "))] = ast.literal_eval(rest)
    assert sorted(rows) == [0, 1, 2, 3], out
    return rows


def assert_whole(rows: dict[int, tuple], kept: set[int]) -> None:
    """Collectives on the world and tp groups work; each rank's groups and mesh are the
    layout's; ``kept`` ranks still hold their variable, the others start afresh."""
    for r, (_, keep, world, tp, tp_ranks, dp_ranks, tp_mesh, dp_mesh) in rows.items():
        assert (world, tp) == (4.0, 2.0), (r, rows[r])
        mine_tp = next(g for g in TP if r in g)
        mine_dp = next(g for g in DP if r in g)
        assert tp_ranks == tp_mesh == mine_tp and dp_ranks == dp_mesh == mine_dp, (r, rows[r])
        assert keep == (r * 100 if r in kept else False), (r, rows[r])


def test_a_rank_that_exits_mid_cell_is_named_and_replaced_alone(four):
    before = fresh_start(four)
    cell = four.run(
        "%%dist\nimport os, time\nif rank == 2:\n    os._exit(7)\ntime.sleep(0.5)\n"
        "dist.all_reduce(torch.ones(1))",
        allow_error=True,
    )
    said = " ".join(message(cell).split())
    assert "rank 2 died (exit code 7)" in text_of(cell) + said
    errors = " ".join(" ".join(o.evalue.split()) for o in cell.outputs if o.output_type == "error")
    assert "%dist_restart --ranks 2 starts a new rank 2; the others keep their variables" in errors
    status = text_of(four.run("print(dist_session.session_line())"))
    assert "needs %dist_restart --ranks 2 (or --hard): rank 2 died" in status, status
    out = text_of(four.run("%dist_restart --ranks 2"))
    assert "rank 2 replaced, the others kept their variables" in out, out
    after = check(four)
    assert_whole(after, kept={0, 1, 3})
    assert all(after[r][0] == before[r][0] for r in (0, 1, 3))  # the same processes
    assert after[2][0] != before[2][0]
    notes = ast.literal_eval(text_of(four.run("print([r.note for r in dist_session.status()])")))
    assert notes[2].startswith("replaced ") and notes[2].endswith(" s ago"), notes
    assert notes[0] == notes[1] == notes[3] == ""
    # the new rank decides as the survivors: on NCCL they aborted and it is told not to bind
    # (binds_device); on gloo nobody aborts, so nothing changes
    cfgs = text_of(
        four.run(
            "%%dist\nfrom infini_notebook.engine.bootstrap import _STATE\n"
            "print('BIND', _STATE['cfg'].get('bind_device', True))"
        )
    )
    assert [line.split("BIND ")[1] for line in cfgs.splitlines() if "BIND" in line] == [
        "True",
        "True",
        "True",
        "True",
    ], cfgs


@pytest.mark.parametrize("how", ["SIGKILL while idle", "SIGSEGV mid-cell", "SIGKILL mid-cell"])
def test_a_killed_rank_is_replaced_and_the_others_keep_everything(four, how):
    before = fresh_start(four)
    if how == "SIGKILL while idle":
        os.kill(before[1][0], signal.SIGKILL)  # a rank of the session this test started
    else:
        sig = how.split()[0]
        four.run(
            f"%%dist\nimport os, signal\nif rank == 1:\n    os.kill(os.getpid(), signal.{sig})",
            allow_error=True,
        )
    four.run(  # the death is seen (a SIGKILL from outside: by its pid)
        "import time\nwhile dist_session.status()[1].state != 'died': time.sleep(0.05)"
    )
    four.run("%dist_restart --ranks 1")
    assert_whole(check(four), kept={0, 2, 3})


def test_two_ranks_at_once_and_a_replacement_that_leaves_a_dead_rank_is_refused(four):
    before = fresh_start(four)
    for r in (0, 3):
        os.kill(before[r][0], signal.SIGKILL)
    four.run(
        "import time\nwhile [r.state for r in dist_session.status()].count('died') < 2:\n"
        "    time.sleep(0.05)"
    )
    refused = four.run("%dist_restart --ranks 3", allow_error=True)
    assert "Cannot replace rank 3 alone: rank 0 died (killed by SIGKILL) too. Run " \
        "%dist_restart --ranks 0,3." in message(refused), message(refused)  # fmt: skip
    four.run("%dist_restart --ranks 0,3")
    assert_whole(check(four), kept={1, 2})


def test_bad_flags_are_refused_in_one_line(four):
    both = four.run("%dist_restart --hard --ranks 1", allow_error=True)
    assert "--hard restarts every rank; --ranks only some" in message(both)
    outside = four.run("%dist_restart --ranks 7", allow_error=True)
    assert "7" in message(outside) and "0-3" in message(outside), message(outside)


def test_only_a_fresh_gpu_rank_that_never_aborted_binds_its_device():
    from infini_notebook.engine.bootstrap import binds_device

    assert binds_device("cuda", {}, aborted=False)  # a start or hard restart: every rank
    assert not binds_device("cuda", {}, aborted=True)  # survivors of a release or replace
    assert not binds_device("cuda", {"bind_device": False}, aborted=False)  # their new peer
    assert not binds_device("cpu", {}, aborted=False)  # gloo binds nothing


WOULD_BIND = """%%dist
from infini_notebook.engine import bootstrap, wait_probe
cfg, aborted = bootstrap._STATE['cfg'], wait_probe.aborted_before()
print('WOULD', bootstrap.binds_device('cuda', cfg, aborted))"""


def would_bind(kernel) -> list[str]:
    """What each rank, in rank order, would decide on a GPU at the next rebuild."""
    out = text_of(kernel.run(WOULD_BIND))
    return [line.split("WOULD ")[1] for line in out.splitlines() if "WOULD" in line]


def test_a_rebuild_after_some_ranks_aborted_has_every_rank_decide_alike(four):
    """A release on NCCL aborts only the ranks it released (tp=2: ranks 2 and 3 finished,
    0 and 1 aborted); at the rebuild the finished ones bound their device and split their
    groups while the aborted ones made each anew, and each side waited for the other. Now
    the kernel asks every rank and tells all one answer. On gloo no rank aborts, so the
    abort is marked here (wait_probe's flag, as abort_groups sets it) on ranks 0 and 1."""
    fresh_start(four)
    four.run("%%dist --ranks 0,1\nfrom infini_notebook.engine import wait_probe\n"
             "wait_probe._aborted.append(True)")  # fmt: skip
    try:
        assert would_bind(four) == ["False", "False", "True", "True"]  # mixed: a hang
        four.run("%dist_restart")
        assert would_bind(four) == ["False"] * 4
        assert_whole(check(four), kept={0, 1, 2, 3})  # the groups work, variables kept
    finally:  # the module's session as it was: no abort, binding allowed
        four.run(
            "%%dist\nfrom infini_notebook.engine import bootstrap, wait_probe\n"
            "wait_probe._aborted.clear(); bootstrap._STATE['cfg']['bind_device'] = True"
        )
    assert would_bind(four) == ["True"] * 4
