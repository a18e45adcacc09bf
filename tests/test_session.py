"""The core session through a real Jupyter kernel, as a user meets it (issue 2)."""

from __future__ import annotations

import socket
import time

import psutil
import pytest
from conftest import message, text_of, use_session

from infini_notebook.core import async_cells

SESSION = "--nprocs 4 --backend gloo --timeout 30"  # the session most tests here share


def kernel_children(kernel) -> list[psutil.Process]:
    return psutil.Process(kernel.kernel_pid).children(recursive=True)


def test_bad_flags_fail_the_cell_and_start_nothing(kernel):
    use_session(kernel, None)
    for line, words in [
        ("%dist_start --gpus 2", "--nprocs"),
        ("%dist_start --nprocs 0", "at least 1"),
        ("%dist_start --nprocs 2 --backend nccl", "nccl"),
        ("%dist_start --nprocs 2 --backend foo", "Unknown --backend"),
        ("%dist_start --nprocs 4 --tp 3", "Bad parallel layout"),
        ("%dist_start --nprocs 2 --bogus 1", "unrecognized arguments"),
    ]:
        cell = kernel.run(line, allow_error=True)
        out = text_of(cell)
        assert words in out, (line, out)
        assert "Traceback" not in out  # one short message, not a kernel-side traceback
        assert any(o.output_type == "error" for o in cell.outputs) or "UsageError" in out
    assert kernel_children(kernel) == []


def test_start_and_collective_on_four_ranks(kernel):
    use_session(kernel, None)  # a fresh start, even after other tests
    use_session(kernel, SESSION)
    cell = kernel.run(
        "%%dist\nx = torch.ones(4) * (rank + 1)\ndist.all_reduce(x)\nprint('sum', x[0].item())"
    )
    out = text_of(cell, "stdout")
    for r in range(4):
        assert f"[rank {r}] sum 10.0" in out


def test_namespace_and_torchrun_environment(kernel):
    use_session(kernel, SESSION)
    cell = kernel.run(
        "%%dist\nimport os\n"
        "print(rank, world_size, local_rank, device, dist.is_initialized(),"
        " os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['LOCAL_RANK'],"
        " os.environ['LOCAL_WORLD_SIZE'], os.environ['GROUP_RANK'], os.environ['MASTER_ADDR'],"
        " os.environ['OMP_NUM_THREADS'])"
    )
    out = text_of(cell, "stdout")
    for r in range(4):
        assert f"[rank {r}] {r} 4 {r} cpu True {r} 4 {r} 4 0 127.0.0.1 1" in out


def test_rank_subset_runs_only_there(kernel):
    use_session(kernel, SESSION)
    out = text_of(kernel.run("%%dist --ranks 0,2\nprint('here', rank)"), "stdout")
    assert "[rank 0] here 0" in out and "[rank 2] here 2" in out
    assert "[rank 1]" not in out and "[rank 3]" not in out
    out = text_of(kernel.run("%%dist --ranks 1-3\nprint('r', rank)"), "stdout")
    assert "[rank 0]" not in out and "[rank 3] r 3" in out


def test_last_expression_is_shown_per_rank(kernel):
    use_session(kernel, SESSION)
    out = text_of(kernel.run("%%dist\nrank * 10"))
    assert "[rank 3] 30" in out and "[rank 1] 10" in out


def test_the_last_output_of_a_cell_is_never_lost(kernel):
    """Output written just before a cell ends, with no newline or on stderr, still arrives
    with the cell (engines skip flushes that have nothing to send; engine_tuning.py)."""
    use_session(kernel, SESSION)
    for _ in range(3):
        cell = kernel.run(
            "%%dist\nimport sys\nprint('err', rank, file=sys.stderr)\n"
            "print('partial', rank, end='')"
        )
        out, err = text_of(cell, "stdout"), text_of(cell, "stderr")
        for r in range(4):
            assert f"[rank {r}] err {r}" in err and f"[rank {r}] partial {r}" in out, (out, err)


def test_exception_on_one_rank_fails_the_cell_and_names_it(kernel):
    use_session(kernel, SESSION)
    cell = kernel.run(
        "%%dist\nif rank == 1:\n    raise ValueError('boom on one')\nprint('ok', rank)",
        allow_error=True,
    )
    errors = [o for o in cell.outputs if o.output_type == "error"]
    assert errors, "the cell must fail so that Run All stops"
    tb = "\n".join(errors[0].traceback)
    assert "[rank 1]" in tb and "boom on one" in tb and "rank 1: ValueError" in tb
    assert "[rank 0]" not in tb
    assert "[rank 0] ok 0" in text_of(cell, "stdout")
    # the session stays usable
    assert "[rank 1] fine" in text_of(kernel.run("%%dist\nprint('fine')"), "stdout")


def test_identical_tracebacks_are_grouped(kernel):
    use_session(kernel, SESSION)
    cell = kernel.run("%%dist\nundefined_name", allow_error=True)
    tb = "\n".join(next(o for o in cell.outputs if o.output_type == "error").traceback)
    assert "[ranks 0-3]" in tb and tb.count("NameError") >= 1


def test_pull_and_push(kernel):
    use_session(kernel, SESSION)
    kernel.run("%%dist\nt = torch.full((2,), float(rank))")
    kernel.run("%dist_pull t")
    out = text_of(kernel.run("print(sorted(t), [v.tolist() for v in t.values()], type(t[0]))"))
    assert "[0, 1, 2, 3] [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]" in out
    assert "torch.Tensor" in out
    kernel.run("factor = 7\n%dist_push factor")
    assert "[rank 2] 14" in text_of(kernel.run("%%dist\nprint(factor * rank)"))
    assert "not defined on this rank" in text_of(kernel.run("%dist_pull nope", allow_error=True))


def test_status_lists_every_rank(kernel):
    use_session(kernel, SESSION)
    out = text_of(kernel.run("%dist_status"))
    for r in range(4):
        assert f"\n   {r} " in out
    assert out.count("idle") >= 4


def test_second_start_is_refused(kernel):
    use_session(kernel, SESSION)
    before = {p.pid for p in kernel_children(kernel)}
    out = text_of(kernel.run("%dist_start --nprocs 2", allow_error=True))
    assert "already running" in out and "%dist_stop" in out
    assert {p.pid for p in kernel_children(kernel)} == before


def test_stop_leaves_no_process_running(kernel):
    use_session(kernel, SESSION)
    children = kernel_children(kernel)
    assert len(children) >= 5  # controller + 4 engines (and their nannies)
    kernel.run("%dist_stop")
    gone, alive = psutil.wait_procs(children, timeout=15)
    assert alive == []
    assert "No session" in text_of(kernel.run("%%dist\n1", allow_error=True))


def test_hard_restart_and_stop_end_every_process_they_started(kernel):
    kernel.run("%dist_stop", allow_error=True)  # whatever an earlier test left running
    # Listed in the same cell as the start: before the spare engines the session forks once
    # idle, which the hard restart may make the ranks.
    started = kernel.run(
        'get_ipython().run_line_magic("dist_start", "--nprocs 4")\n'
        "import psutil\nprint([p.pid for p in psutil.Process().children(recursive=True)])",
        timeout=180,
    )
    # a hard restart keeps the watchdog, the controller (new engines register with it) and
    # the warm template (new engines fork from it); every engine and nanny is new
    # the controller (with its schedulers and heart monitor) is forked from the template
    # when it is ready: named ipcontroller, with the template's command line
    kept = ("infini_notebook.launch.watchdog", "infini_notebook.launch.controller", "ipcontroller:")
    template = int(text_of(kernel.run("print(dist_session.engines.template.process.pid)")))
    before = [psutil.Process(p) for p in eval(text_of(started).strip().splitlines()[-1])]
    first = [p for p in before if not any(k in _cmd(p) for k in kept) and p.pid != template]
    controller = {p.pid for p in before if any(k in _cmd(p) for k in kept[1:])}
    assert len(first) >= 8 and controller  # 4 engines and their nannies
    kernel.run("%dist_restart --hard", timeout=180)
    assert psutil.wait_procs(first, timeout=15)[1] == []
    assert controller | {template} <= {p.pid for p in kernel_children(kernel)}
    out = text_of(kernel.run("%%dist\nx = torch.ones(1); dist.all_reduce(x); print(x.item())"))
    assert all(f"[rank {r}] 4.0" in out for r in range(4))
    second = kernel_children(kernel)
    assert len(second) >= 9  # controller, 4 engines and their nannies
    stopped = kernel.run("%dist_stop")
    assert psutil.wait_procs(second, timeout=15)[1] == []
    assert text_of(stopped).strip() == "Session stopped."  # no warnings about killed engines
    assert "No session" in text_of(kernel.run("%%dist\n1", allow_error=True))


def _cmd(p: psutil.Process) -> str:
    try:
        return f"{p.name()}: {' '.join(p.cmdline())}"
    except psutil.Error:
        return ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("method", ["tcp", "file"])
def test_init_methods_tcp_and_file(kernel, method, tmp_path):
    use_session(kernel, None)
    url = f"tcp://127.0.0.1:{_free_port()}" if method == "tcp" else f"file://{tmp_path}/store"
    kernel.run(f"%dist_start --nprocs 2 --init-method {url}", timeout=180)
    out = text_of(
        kernel.run("%%dist\nx = torch.tensor([rank + 1.0]); dist.all_reduce(x); print(x.item())")
    )
    assert "[rank 0] 3.0" in out and "[rank 1] 3.0" in out
    kernel.run("%dist_stop")


def test_collapse_merges_ranks_that_print_at_slightly_different_times(kernel):
    use_session(kernel, SESSION)
    out = text_of(
        kernel.run("%%dist --collapse\nimport time\ntime.sleep(rank * 0.2)\nprint('same')")
    )
    assert out.strip() == "[ranks 0-3] same"
    kernel.run("%dist_stop")


def test_start_shows_a_progress_bar_that_ends_complete(kernel):
    use_session(kernel, None)
    cell = kernel.run("%dist_start --nprocs 2", timeout=180)
    bars = [o for o in cell.outputs if "%dist_start" in o.get("data", {}).get("text/plain", "")]
    assert bars, "a progress display"
    # the display is updated in place; nbclient keeps the last state
    assert "2/2 ranks initialised" in bars[-1]["data"]["text/plain"]
    kernel.run("%dist_stop")


def test_top_level_await_is_refused_at_once_with_what_works_instead(kernel):
    """Issue 39: an engine never answers a cell that awaits at its top level (the cell hung
    until interrupted). It is refused before it is sent, in one line, and the way it names
    runs the coroutine on every rank."""
    use_session(kernel, SESSION)
    t0 = time.monotonic()
    cell = kernel.run("%%dist\nimport asyncio\nawait asyncio.sleep(0)", allow_error=True)
    err, said = text_of(cell, "error"), message(cell)
    assert time.monotonic() - t0 < 5
    assert "Line 2 awaits at the top level" in said and "ThreadPoolExecutor" in said, said
    assert "\n" not in said.strip() and "Traceback" not in err  # one message, no traceback
    instead = (
        f"%%dist\n{async_cells.IMPORTS}\n"
        "async def main():\n    await asyncio.sleep(0.01)\n    return rank * 2\n"
        f"print('got', {async_cells.INSTEAD})"
    )
    out = text_of(kernel.run(instead), "stdout")
    assert all(f"[rank {r}] got {2 * r}" in out for r in range(4)), out


@pytest.mark.parametrize(
    "source, line",
    [
        ("import asyncio\nawait asyncio.sleep(1)", 2),
        ("async with lock:\n    pass", 1),
        ("x = [i async for i in g()]", 1),
        ("async def f():\n    await g()\nx = 1", None),
        ("f = lambda: 1\nprint(f())", None),
        ("def broken(:\n", None),  # a syntax error is the rank's to report
        ("import asyncio\ndef f(a=await asyncio.sleep(0, 5)):\n    return a", 2),  # default
        ("@(await make())\ndef f():\n    pass", 1),  # decorators run as it is defined
        ("f = lambda a=await x: a", 1),
        ("def f(x: await y):\n    pass", 1),  # annotations too
        ("class C:\n    async def m(self):\n        await g()", None),
        ("s = 'await x'", None),
    ],
)
def test_top_level_await_is_found_only_outside_functions(source, line):
    assert async_cells.top_level_await(source) == line
