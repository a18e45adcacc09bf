"""A released rank fails its cell (engine/cell_end.py), tested on this process's own main
thread: the release comes from another thread, as the rank's answering thread sends it."""

from __future__ import annotations

import threading
import time

import pytest

from infini_notebook.engine import cell_end


def in_cell(fn):
    with cell_end._lock:
        cell_end._state.update(in_cell=True, why=None)
    try:
        return fn()
    finally:
        cell_end.finish(succeeded=False)


def test_an_interrupting_release_raises_in_the_cell_thread_even_in_native_waits():
    def cell():
        threading.Timer(0.2, cell_end.release, ("released for the test", True)).start()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.01)  # stands in for a sync that returns once NCCL is aborted
        return "went on"

    with pytest.raises(cell_end.RankReleased, match="released for the test"):
        in_cell(cell)


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
