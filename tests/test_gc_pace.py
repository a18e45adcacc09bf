"""kernel/gc_pace.py: while cells run, the collector's young generation waits for more new
objects (per rank); the user's own thresholds come back once the last cell ends, also
when cells overlap (a --background cell beside the foreground one) or fail."""

from __future__ import annotations

import gc
import threading

import pytest

from infini_notebook.kernel import gc_pace


@pytest.fixture
def user_thresholds():
    saved = gc.get_threshold()
    gc.set_threshold(700, 11, 12)
    yield (700, 11, 12)
    gc.set_threshold(*saved)


def test_a_cell_raises_the_threshold_with_its_ranks_and_puts_it_back(user_thresholds):
    with gc_pace.paced(1024):
        assert gc.get_threshold() == (gc_pace.PER_RANK * 1024, 11, 12)
    assert gc.get_threshold() == user_thresholds
    with gc_pace.paced(4):  # 100 objects: the user's 700 stays
        assert gc.get_threshold() == user_thresholds
    assert gc.get_threshold() == user_thresholds


def test_a_failing_cell_puts_it_back_too(user_thresholds):
    with pytest.raises(KeyboardInterrupt):
        with gc_pace.paced(512):
            raise KeyboardInterrupt  # the Stop button
    assert gc.get_threshold() == user_thresholds


def test_overlapping_cells_keep_the_larger_until_the_last_ends(user_thresholds):
    entered, leave = threading.Event(), threading.Event()

    def background():
        with gc_pace.paced(2048):
            entered.set()
            leave.wait(10)

    t = threading.Thread(target=background)
    t.start()
    entered.wait(10)
    with gc_pace.paced(256):
        assert gc.get_threshold()[0] == gc_pace.PER_RANK * 2048
    assert gc.get_threshold()[0] == gc_pace.PER_RANK * 2048  # the background cell runs on
    leave.set()
    t.join(10)
    assert gc.get_threshold() == user_thresholds


def test_a_higher_threshold_of_the_users_is_kept(user_thresholds):
    gc.set_threshold(100_000, 11, 12)
    with gc_pace.paced(64):
        assert gc.get_threshold() == (100_000, 11, 12)
    assert gc.get_threshold() == (100_000, 11, 12)


def test_a_finished_cell_goes_without_the_collector():
    """A cell and its ranks' futures are freed when the last reference goes: a cycle
    between them (a strong callback) left ~40 objects per rank per cell to the cyclic
    collector, a third of the kernel's CPU per cell at 1,024 ranks (docs/scale.md)."""
    import contextlib
    import io
    import weakref

    from infini_notebook.core.output import StreamLabeler
    from infini_notebook.kernel.cell import Cell
    from infini_notebook.kernel.printers import TextPrinter
    from infini_notebook.launch.relay_cells import RankFuture, RelayedCell

    ranks = list(range(8))
    gc.collect()
    gc.disable()
    try:
        with contextlib.redirect_stdout(io.StringIO()) as shown:
            futures = {r: RankFuture("m", r) for r in ranks}
            cell = Cell(RelayedCell("m", [], futures), ranks, StreamLabeler(), TextPrinter(True))
            for r, f in futures.items():
                f.stream("stdout", f"hello from {r}\n")
                f.reply({"status": "ok", "execution_count": 1}, unwrap=None)
                f.idle()
            cell.wait_for_trailing_output()
            cell.show(final=True)
            cell.render_final()
        assert "[rank 7] hello from 7" in shown.getvalue()  # the cell did run its course
        gone = [weakref.ref(cell), *(weakref.ref(f) for f in futures.values())]
        del cell, futures, f
        assert [ref() for ref in gone] == [None] * len(gone)
    finally:
        gc.enable()
