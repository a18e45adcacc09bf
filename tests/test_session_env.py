"""What a session's ranks inherit (issue 12, items 4 and 6): every parallel group gets the
session's --timeout, and the environment lets torchrun-style code run unchanged, with real
engines on gloo in a real kernel. Each test leaves the session healthy, so any order works."""

from __future__ import annotations

import pytest
from conftest import fresh_kernel, text_of

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def tp_kernel():
    """4 CPU ranks, tp=2 (dp=2), collectives time out after 5 s."""
    with fresh_kernel() as cells:
        cells.run("%dist_start --nprocs 4 --tp 2 --timeout 5", timeout=180)
        yield cells
        cells.run("%dist_stop", allow_error=True)


def error_text(cell) -> str:
    return "\n".join("\n".join(o.traceback) for o in cell.outputs if o.output_type == "error")


def test_hang_inside_a_tp_group_fails_at_the_session_timeout(tp_kernel):
    tp_kernel.run("%%dist\nkeep = rank")
    # rank 1 computes past the timeout instead of joining its tp group's all_reduce: rank 0
    # waits in groups.tp, not in the world group, for a rank still running (no release).
    # Without the session's timeout on tp, it would wait torch's 30 minutes and this cell
    # would hit its own 90 s limit instead of failing.
    cell = tp_kernel.run(
        "%%dist\nimport time\nx = torch.ones(1)\nif rank != 1:\n"
        "    dist.all_reduce(x, group=groups.tp)\nelse:\n    time.sleep(9)\nprint('done', rank)",
        allow_error=True,
        timeout=90,
    )
    err = error_text(cell)
    assert "rank 0" in err and "timed out" in err.lower(), err[-3000:]
    assert "released" not in err
    assert "%dist_restart" in err
    tp_kernel.run("%dist_restart", timeout=120)
    out = text_of(
        tp_kernel.run(
            "%%dist\ny = torch.ones(1)\ndist.all_reduce(y, group=groups.tp)\nprint(y.item(), keep)"
        )
    )
    assert "[rank 0] 2.0 0" in out and "[rank 3] 2.0 3" in out  # tp works, variables kept


def test_init_parallel_groups_without_arguments_is_the_sessions_layout(tp_kernel):
    out = text_of(
        tp_kernel.run(
            "%%dist\nfrom infini_notebook.groups import init_parallel_groups\n"
            "again = init_parallel_groups()\n"
            "print(again.layout == layout, again is groups, again.tp_size)"
        )
    )
    for r in range(4):
        assert f"[rank {r}] True True 2" in out, out


REINIT = (
    "%%dist\ndist.destroy_process_group()\ndist.init_process_group('gloo')\n"
    "x = torch.tensor([rank + 1.0])\ndist.all_reduce(x)\nprint('sum', x.item())"
)


def test_users_own_env_init_after_destroy_works_and_restart_brings_groups_back(tp_kernel):
    # torchrun code re-initialising by itself: env:// must join the kernel's store (not try to
    # host one on its port), and a second re-init must not trip over the first one's keys
    for _ in range(2):
        out = text_of(tp_kernel.run(REINIT, timeout=60))
        assert out.count("sum 10.0") == 4, out
    tp_kernel.run("%dist_restart", timeout=120)
    out = text_of(
        tp_kernel.run(
            "%%dist\ny = torch.ones(1)\ndist.all_reduce(y, group=groups.tp)\n"
            "print('tp', y.item(), dist.get_world_size())"
        )
    )
    for r in range(4):
        assert f"[rank {r}] tp 2.0 4" in out, out
    out = text_of(tp_kernel.run(REINIT, timeout=60))  # and again after the restart
    assert out.count("sum 10.0") == 4, out
    tp_kernel.run("%dist_restart", timeout=120)
