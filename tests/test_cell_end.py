"""A released rank fails its cell (engine/cell_end.py), tested on this process's own main
thread: the release comes from another thread, as the rank's answering thread sends it."""

from __future__ import annotations

import random
import sys
import threading
import time
import types

import pytest
import torch

from infini_notebook.engine import cell_end


def in_cell(fn):
    with cell_end._lock:
        cell_end._state.update(in_cell=True, why=None)
    try:
        return fn()
    finally:
        cell_end.finish(succeeded=False)


class Parked:
    """A native wait that only the "abort" ends: ``wait`` is a held lock's C ``acquire``,
    as ``work.wait()`` or ``x.item()`` block in torch's C++ until NCCL is aborted."""

    def __init__(self):
        self.lock = threading.Lock()
        self.lock.acquire()
        self.wait = self.lock.acquire

    def abort(self):
        self.lock.release()


def release_then_abort(parked: Parked, delay: float) -> None:
    """What rank_services.abort does, in its order: mark the release, then abort."""

    def go():
        cell_end.release("released for the test", True)
        parked.abort()

    threading.Timer(delay, go).start()


def test_a_release_raises_in_a_thread_parked_in_a_wait_as_that_wait_returns():
    parked, exits = Parked(), []

    class Mine:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            exits.append(exc[0])

    def cell():
        release_then_abort(parked, 0.1)
        with torch.no_grad(), Mine():
            parked.wait()  # the exception fires here, as the wait returns
            return "went on"

    with pytest.raises(cell_end.RankReleased, match="released for the test"):
        in_cell(cell)
    assert exits == [cell_end.RankReleased]  # the with block saw it, as any exception
    assert torch.is_grad_enabled()


def test_a_release_never_raises_into_python_code_that_is_running():
    """A thread running Python (a sync returned at once, as NCCL's do) is not interrupted:
    its cell fails at its end instead, and nothing it was doing is cut short."""

    def cell():
        threading.Timer(0.05, cell_end.release, ("released for the test", True)).start()
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            time.sleep(0.005)
        return "went on"

    with cell_end._lock:
        cell_end._state.update(in_cell=True, why=None)
    assert cell() == "went on"
    error = cell_end.finish(succeeded=True)
    assert isinstance(error, cell_end.RankReleased) and "released for the test" in str(error)


class Counted:
    """A user's own context manager: every __enter__ must meet its __exit__."""

    def __init__(self):
        self.depth = 0

    def __enter__(self):
        self.depth += 1

    def __exit__(self, *exc):
        self.depth -= 1


CONTEXTS = {
    "no_grad": lambda: torch.no_grad(),
    "inference_mode": lambda: torch.inference_mode(),
    "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
}


@pytest.mark.parametrize("kind", [*CONTEXTS, "user"])
def test_a_release_at_any_moment_leaves_torch_and_user_state_as_it_was(kind):
    """Issue 39's reproduction, 50 of 50: a release lands while the cell loops through a
    context manager; afterwards grad mode, inference mode, autocast and the user's own
    context are as before, and the cell fails (at its end)."""
    rng = random.Random(39)
    counted = Counted()
    make = CONTEXTS.get(kind, lambda: counted)
    for run in range(50):
        with cell_end._lock:
            cell_end._state.update(in_cell=True, why=None)
        timer = threading.Timer(rng.uniform(0, 0.02), cell_end.release, ("released", True))
        timer.start()
        deadline = time.monotonic() + 0.03
        while time.monotonic() < deadline:
            with make():
                pass
        timer.join()
        error = cell_end.finish(succeeded=True)
        assert isinstance(error, cell_end.RankReleased), run
        state = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                 torch.is_autocast_enabled("cpu"), counted.depth)  # fmt: skip
        assert state == (True, False, False, 0), (run, state)


@pytest.mark.parametrize(
    "line, parked",
    [
        ("x.item()", True),
        ("work.wait()", True),
        ("work.wait(timeout)", True),
        ("work.wait(cfg.timeout)", True),
        ("work.wait(timeout=cfg.timeout)", True),
        ("torch.cuda.synchronize()", True),
        ("y = x.tolist()", True),
        ("x.sum()", False),
        ("time.sleep(1)", False),
        ("time.sleep(cfg.wait)", False),  # an argument's attribute is not the callee
        ("q.get(timeout=cfg.wait)", False),
        ("f(x.cpu)", False),
        ("f(x.item())", False),  # stopped at f's call, the item() long done
    ],
)
def test_a_known_wait_is_recognised_by_the_call_a_frame_is_stopped_at(line, parked):
    """parked_in_wait on real frames stopped at a real call (``sys._getframe`` from inside
    the callee's stand-in gives the caller's frame, stopped at that very call)."""
    seen = {}

    def stopped(*args, **kw):
        seen["parked"] = cell_end.parked_in_wait(sys._getframe(1))

    class Stub:
        item = tolist = wait = synchronize = sum = get = cpu = staticmethod(stopped)
        cuda = None
        timeout = wait_s = 1

    Stub.cuda = Stub
    cfg = types.SimpleNamespace(wait=1, timeout=1)
    names = dict(x=Stub, work=Stub, torch=Stub, time=types.SimpleNamespace(sleep=stopped),
                 f=stopped, timeout=1, cfg=cfg, q=Stub)  # fmt: skip
    exec(compile(line, "<cell>", "exec"), names)
    assert seen["parked"] is parked


def test_a_release_swallowed_by_the_cell_still_fails_it():
    with cell_end._lock:
        cell_end._state.update(in_cell=True, why=None)
    assert cell_end.release("disconnected", interrupt=False)
    error = cell_end.finish(succeeded=True)
    assert isinstance(error, cell_end.RankReleased) and "disconnected" in str(error)
    assert cell_end.finish(succeeded=True) is None  # the next cell starts clean


def test_no_release_outside_a_cell_and_nothing_fires_later():
    assert not cell_end.release("between cells", interrupt=True)
    time.sleep(0.05)  # a stray asynchronous exception would fire on this line
    assert cell_end.finish(succeeded=True) is None


def test_no_release_raises_into_an_exit_that_waits():
    """torch's profiler synchronizes in its __exit__ before it disables itself: a release
    parked there waits for the cell's end instead of leaving the profiler recording."""
    parked = Parked()

    class Profiler:
        recording = False

        def __enter__(self):
            Profiler.recording = True
            return self

        def __exit__(self, *exc):
            parked.wait()  # the exit's own sync
            Profiler.recording = False

    def cell():
        release_then_abort(parked, 0.1)
        with Profiler():
            pass
        return "went on"

    with cell_end._lock:
        cell_end._state.update(in_cell=True, why=None)
    assert cell() == "went on"
    assert not Profiler.recording
    assert isinstance(cell_end.finish(succeeded=True), cell_end.RankReleased)


TRACED_AFTER_CELLS = """
import sys, threading
from infini_notebook.engine import cell_end

def cell(release):
    with cell_end._lock:
        cell_end._state.update(in_cell=True, why=None)
    lock = threading.Lock()
    lock.acquire()
    work = type("Work", (), {"wait": lock.acquire})()  # a native wait, as work.wait()
    if release:  # parked in it: the release's exception fires as that wait returns
        def go():
            assert cell_end.release("released", True)
            lock.release()
        threading.Timer(0.1, go).start()
        try:
            work.wait()
            print("not released")
        except cell_end.RankReleased:
            pass
    cell_end.finish(succeeded=False)

cell(False)
cell(True)
sys.settrace(lambda frame, event, arg: None)  # as pdb's n or s steps: a tracer, no stop
(lambda: 1)()
sys.settrace(None)
print("traced")
"""


def test_a_cells_end_leaves_nothing_that_hangs_a_debugger_stepping_later():
    """Issue 40 item 3: finish() cleared a pending release with PyThreadState_SetAsyncExc
    (NULL), which leaves CPython 3.11's eval breaker set; under a tracer every function call
    then spun for ever, so pdb's n hung a rank in any cell after its first."""
    import subprocess

    run = subprocess.run([sys.executable, "-c", TRACED_AFTER_CELLS], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert run.stdout.strip() == "traced", run.stderr
