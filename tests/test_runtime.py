"""The session over time (issue 12, items 3, 7, 8): a background cell beside other work,
memory that does not pile up cell after cell, and no process outliving its kernel, whenever
the kernel dies."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
from conftest import fresh_kernel, text_of

from infini_notebook.core.errors import DistUsageError

pytestmark = pytest.mark.timeout(600)


def error_text(cell) -> str:
    return "\n".join("\n".join(o.traceback) for o in cell.outputs if o.output_type == "error")


# ----- item 7: nothing keeps a finished cell's values ------------------------------------------
def test_a_cells_last_value_is_freed_on_the_ranks_and_in_the_client(session4):
    session4.run(
        "import weakref\nbig = torch.ones(1_000_000)\nref = weakref.ref(big)\nbig", echo=False
    )
    assert "1." in session4.last.results[0]["text/plain"]  # the value did come back
    session4.run("del big", echo=False)  # the next cell: only Out/_ could still hold it
    freed = session4.run("ref() is None", echo=False).results
    assert {r: v["text/plain"] for r, v in freed.items()} == {r: "True" for r in range(4)}
    for _ in range(3):
        session4.run("1", echo=False)
    session4.pull("rank")
    client = session4.engines.client.ipp_client
    with session4.engines.client.lock:  # the session purges the controller from its own thread
        assert client.outstanding == set()
        assert client.results == {} and len(client.history) == 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with session4.engines.client.lock:
            records = client.hub_history()
        if not records:
            break
        time.sleep(0.2)
    assert records == []  # the controller keeps no results either (the pull's values)


# ----- item 3: one background cell, beside status and stacks ------------------------------------
@pytest.fixture(scope="module")
def two_ranks(kernel):
    kernel.run(
        "from infini_notebook import cluster as _c\n"
        "if _c.current() is None or _c.current().world_size != 2:\n"
        "    %dist_stop\n"
        "    %dist_start --nprocs 2",
        timeout=180,
    )
    return kernel


def wait_idle(kernel, timeout=30):
    kernel.run(
        "import time\nwhile any(r.state == 'busy' for r in dist_session.status()):\n"
        "    time.sleep(0.2)",
        timeout=timeout,
    )


def test_run_where_picks_the_ranks_at_layout_coordinates(session4):
    # tp=2, dp=2: dp=1 holds ranks 2 and 3, whether the coordinates come as text or a dict
    for where in ("dp=1", {"dp": 1}):
        result = session4.run("print(rank)", where=where, echo=False)
        assert result.ranks == [2, 3]
        assert result.stdout == {2: "2\n", 3: "3\n"}
    with pytest.raises(DistUsageError, match="--ranks or --where"):
        session4.run("1", ranks="0", where="dp=1")
    with pytest.raises(DistUsageError, match="Bad --where"):
        session4.run("1", where="xx=1")


def test_work_beside_a_background_cell_is_refused_and_it_is_left_alone(two_ranks, tmp_path):
    kernel = two_ranks
    gate = tmp_path / "gate"  # the ranks crunch until the test removes it
    gate.touch()
    kernel.run(
        f"%%dist --background\nimport os, time\ndef crunch():\n"
        f"    while os.path.exists({str(gate)!r}):\n        time.sleep(0.05)\ncrunch()\n"
        "print('background done', rank)"
    )
    for line in (
        "%%dist\nprint('foreground')",
        "%%dist --ranks 1\nprint('foreground')",
        "%%dist --background\nprint('second')",
        "%dist_pull rank",
        "%dist_restart",
    ):
        cell = kernel.run(line, allow_error=True)
        out = text_of(cell)
        assert "background cell is running on ranks 0-1" in out, (line, out)
        assert "%dist_interrupt" in out and "foreground" not in text_of(cell, "stdout")
        assert "Traceback" not in out
    # what --background is for still works beside it
    deadline = time.monotonic() + 60
    while True:  # both ranks in it (a slow start is no failure), or 60 s
        stacks = text_of(kernel.run("%dist_stacks"))
        if stacks.count("in crunch") == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert stacks.count("in crunch") == 2, stacks
    assert "['busy', 'busy']" in text_of(
        kernel.run("print([r.state for r in dist_session.status()])")
    )

    def press_stop():  # Jupyter's stop button, on a notebook cell that is not the background one
        time.sleep(1)
        os.kill(kernel.kernel_pid, signal.SIGINT)

    threading.Thread(target=press_stop).start()
    kernel.run("import time\ntime.sleep(10)", allow_error=True)
    gate.unlink()
    wait_idle(kernel)
    out = text_of(kernel.run("print(dist_session.last.stdout)"))
    assert "background done 0" in out and "background done 1" in out  # ran to its end
    assert "[rank 1] ok" in text_of(kernel.run("%%dist\nprint('ok')"))


def test_interrupt_stops_the_background_cell_and_then_work_goes_on(two_ranks, tmp_path):
    kernel = two_ranks
    assert "No background cell" in text_of(kernel.run("%dist_interrupt"))
    there = tmp_path / "there"
    kernel.run(
        "%%dist --background --ranks 0\nimport time\n"
        f"open({str(there)!r}, 'w').close(); time.sleep(60)"
    )
    deadline = time.monotonic() + 60
    while not there.exists():  # rank 0 is in the cell: the interrupt finds it there
        assert time.monotonic() < deadline, "rank 0 did not start the cell"
        time.sleep(0.02)
    assert "Interrupted ranks [0]" in text_of(kernel.run("%dist_interrupt"))
    wait_idle(kernel, timeout=20)
    assert "KeyboardInterrupt" in text_of(kernel.run("print(dist_session.last.errors)"))
    out = text_of(kernel.run("%%dist\nprint('after', rank)"), "stdout")
    assert "[rank 0] after 0" in out and "[rank 1] after 1" in out


# ----- item 8: no process outlives its kernel ----------------------------------------------------
def _cmd(p: psutil.Process) -> str:
    """Its name (an engine forked from the warm template is named ``ipengine``: its command
    line is the template's) and its command line."""
    try:
        return f"{p.name()}: {' '.join(p.cmdline())}"
    except psutil.Error:
        return ""


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _marked(profile_dirs: set[str]) -> list[psutil.Process]:
    """Live processes carrying one of these session marks (ipyparallel's IPP_PROFILE_DIR)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("IPP_PROFILE_DIR") in profile_dirs and p.status() != "zombie":
                found.append(p)
        except psutil.Error:
            pass
    return found


def _kill_when(cells, source: str, ready) -> tuple[dict[psutil.Process, str], set[str]]:
    """Run ``source`` in the kernel and SIGKILL the kernel as soon as ``ready(procs)`` holds
    for its session's processes. Returns every process of the session seen until then, with
    its command line, and the session's mark."""
    cells.client.kc.execute(source)  # sent, not waited for: the kernel dies under it
    seen: dict[psutil.Process, str] = {}
    marks: set[str | None] = set()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for p in _descendants(cells.kernel_pid):
            seen[p] = _cmd(p) or seen.get(p, "")  # a forked engine renames itself
            marks.add(_mark(p))
        if ready(seen):
            psutil.Process(cells.kernel_pid).kill()
            return seen, marks - {None}
        time.sleep(0.02)
    raise AssertionError("the session's processes never appeared")


def _mark(p: psutil.Process) -> str | None:
    try:
        return p.environ().get("IPP_PROFILE_DIR")
    except psutil.Error:
        return None


def _assert_all_gone(seen: dict[psutil.Process, str], marks: set[str], t0, what: str) -> None:
    assert marks, "no process of the session was seen"
    _, alive = psutil.wait_procs(list(seen), timeout=15)
    assert alive == [], (what, [(p.pid, seen[p]) for p in alive])
    late = _marked(marks)  # started after our last look, by a launcher caught halfway
    if late:
        _, late = psutil.wait_procs(late, timeout=15 - (time.monotonic() - t0))
    assert late == [], (what, [(p.pid, _cmd(p)) for p in late])


def _engines(seen: dict[psutil.Process, str], exclude=()) -> list[psutil.Process]:
    return [
        p
        for p, cmd in seen.items()
        if ("ipyparallel.engine" in cmd or cmd.startswith("ipengine:")) and p.pid not in exclude
    ]


def test_kernel_killed_while_engines_come_up_leaves_nothing():
    with fresh_kernel() as cells:
        seen, marks = _kill_when(cells, "%dist_start --nprocs 2", lambda ps: len(_engines(ps)) >= 1)
        t0 = time.monotonic()
        # the controller: started as usual, or forked from the warm template (ipcontroller)
        assert any(
            "infini_notebook.launch.controller" in cmd or cmd.startswith("ipcontroller:")
            for cmd in seen.values()
        )
        _assert_all_gone(seen, marks, t0, "kernel killed while engines start")


def test_kernel_killed_during_a_hard_restart_leaves_nothing():
    with fresh_kernel() as cells:
        cells.run("%dist_start --nprocs 2", timeout=180)
        old = {p.pid for p in _engines({p: _cmd(p) for p in _descendants(cells.kernel_pid)})}
        seen, marks = _kill_when(
            cells, "%dist_restart --hard", lambda ps: len(_engines(ps, exclude=old)) >= 1
        )
        t0 = time.monotonic()
        _assert_all_gone(seen, marks, t0, "kernel killed during a hard restart")


def test_a_failed_hard_restart_stops_everything_with_a_clear_error():
    with fresh_kernel() as cells:
        cells.run("%dist_start --nprocs 2", timeout=180)
        started = _descendants(cells.kernel_pid)
        # a real failure: no Python can start with this, so the new controller exits at once
        cells.run("import os\nos.environ['PYTHONHOME'] = '/nonexistent'")
        cell = cells.run("%dist_restart --hard", allow_error=True, timeout=180)
        cells.run("del os.environ['PYTHONHOME']")
        err = error_text(cell)
        assert "Hard restart failed" in err and "nothing is left running" in err
        assert "%dist_start" in err
        assert "Traceback (most recent call last)" not in err.split("DistCellError")[-1]
        assert "False" in text_of(cells.run("print(dist_session.running)"))
        _, alive = psutil.wait_procs(started, timeout=10)
        assert alive == [], [(p.pid, _cmd(p)) for p in alive]
        assert _descendants(cells.kernel_pid) == []  # the watchdog too
        out = text_of(cells.run("%dist_start --nprocs 2\n%dist_stop", timeout=180))
        assert "2 ranks ready" in out  # and a new session starts
