"""Auto mode (%dist_auto) and post-mortem inspection (%dist_debug) in a real kernel (issue 14)."""

from __future__ import annotations

import sys

from conftest import text_of

from infini_notebook.core.automode import AUTO_MARKER, auto_cell_lines
from infini_notebook.engine.postmortem import failing_frame, run_in_frame


def ensure_session(kernel) -> None:
    """Auto mode off and 4 ranks up, whatever ran before (tests run alone or in any order)."""
    kernel.run("%dist_auto off")
    out = text_of(
        kernel.run(
            "import os, infini_notebook as _inb\nKERNEL_PID = os.getpid()\n"
            "print('need', _inb.current() is None)"
        )
    )
    if "need True" in out:
        kernel.run("%dist_start --nprocs 4 --timeout 30", timeout=180)


def errors_of(cell) -> str:
    return "\n".join("\n".join(o.traceback) for o in cell.outputs if o.output_type == "error")


# ----- pure parts ---------------------------------------------------------------------------
def test_auto_transformer_wraps_plain_cells_and_leaves_magics_to_the_kernel():
    wrapped = auto_cell_lines(["x = 1\n", "print(x)\n"])
    assert wrapped == ["get_ipython().run_cell_magic('dist_auto', '', 'x = 1\\nprint(x)\\n')\n"]
    for kept in (
        ["%dist_status\n"],
        ["%dist_auto off\n"],
        ["%%time\n", "x = 1\n"],
        ["\n", "# a comment\n", "  %dist_stacks\n"],
        ["!ls\n"],
        ["\n", "   \n"],
    ):
        assert auto_cell_lines(kept) == kept


def _raise_inside(is_cell_file):
    def user_step():
        x = 42
        [].pop()  # raises inside a builtin, like a torch op
        return x

    try:
        user_step()
    except IndexError as e:
        return failing_frame(e.__traceback__, is_cell_file)


def test_failing_frame_is_the_innermost_user_frame_else_the_innermost():
    this_file = __file__
    frame = _raise_inside(lambda name: name == this_file)
    assert frame.f_code.co_name == "user_step" and frame.f_locals["x"] == 42
    assert _raise_inside(lambda name: False).f_code.co_name == "user_step"
    assert failing_frame(None, lambda name: True) is None


def test_run_in_frame_sees_locals_in_comprehensions_and_shows_the_last_value():
    def where():
        y = 3
        return sys._getframe() if y else None

    frame = where()
    assert run_in_frame("print([y * i for i in range(3)])\ny + 1", frame) == "[0, 3, 6]\n4\n"
    assert run_in_frame("z = y", frame) == ""


# ----- in a kernel --------------------------------------------------------------------------
def test_auto_mode_runs_plain_cells_on_every_rank(kernel):
    ensure_session(kernel)
    assert "Auto mode on" in text_of(kernel.run("%dist_auto on"))
    out = text_of(kernel.run("print('hi', rank)"))
    assert out.startswith(AUTO_MARKER), out
    for r in range(4):
        assert f"[rank {r}] hi {r}" in out
    # line magics still run in the kernel, as does a magic after a comment
    status = text_of(kernel.run("%dist_status"))
    assert AUTO_MARKER not in status and status.count("idle") >= 4
    failed = kernel.run("if rank == 2:\n    raise ValueError('auto boom')", allow_error=True)
    tb = errors_of(failed)
    assert "[rank 2]" in tb and "auto boom" in tb and "DistCellError" in tb
    assert "[rank 0]" not in tb
    assert "Auto mode off" in text_of(kernel.run("# back to the kernel\n%dist_auto"))
    out = text_of(kernel.run("import os\nprint('kernel', os.getpid() == KERNEL_PID)"))
    assert out == "kernel True\n"


def test_stopping_the_session_turns_auto_mode_off(kernel):
    ensure_session(kernel)
    kernel.run("%dist_auto on")
    out = text_of(kernel.run("%dist_stop"))
    assert "Session stopped" in out and "Auto mode off (the session stopped)" in out
    out = text_of(kernel.run("import os\nprint('kernel', os.getpid() == KERNEL_PID)"))
    assert out == "kernel True\n"
    refused = text_of(kernel.run("%dist_auto on", allow_error=True))
    assert "No session is running" in refused and "Traceback" not in refused


def test_post_mortem_shows_locals_where_each_failed_rank_raised(kernel):
    ensure_session(kernel)
    cell = kernel.run(
        "%%dist\n"
        "def step():\n"
        "    x = rank * 10\n"
        "    if rank in (1, 3):\n"
        "        torch.ones(4).split([1, 1])  # raises inside torch's own Python\n"
        "    return x\n"
        "step()",
        allow_error=True,
    )
    # one traceback for both: in the error, or (a rank that failed while others still ran)
    # in the note shown as it came, merged at the cell's end (on a loaded machine)
    assert "[ranks 1,3]" in text_of(cell), text_of(cell)
    kernel.run("%dist_pull nope", allow_error=True)  # a failing call must not lose the frames
    out = text_of(kernel.run("%dist_debug print('x =', x)"))
    assert "[rank 1] x = 10" in out and "[rank 3] x = 30" in out
    assert "[rank 0]" not in out and "[rank 2]" not in out
    out = text_of(kernel.run("%%dist_debug --ranks 3\ny = x + 1\ny"))
    assert out.strip() == "[rank 3] 31"
    wrong = text_of(kernel.run("%%dist_debug --ranks 0\nx", allow_error=True))
    assert "failed in the last cell; pick --ranks among them" in wrong, wrong
    # in auto mode the magic still runs in the kernel
    kernel.run("%dist_auto on")
    assert "[rank 1] x = 10" in text_of(kernel.run("%dist_debug print('x =', x)"))
    kernel.run("%dist_auto off")


def test_post_mortem_after_a_cell_that_did_not_fail_says_so(kernel):
    ensure_session(kernel)
    kernel.run("%%dist\nok = rank")
    out = text_of(kernel.run("%dist_debug print(ok)", allow_error=True))
    assert "The last cell did not fail" in out and "Traceback" not in out
