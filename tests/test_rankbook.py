"""The RankBook: what the kernel knows of each rank between calls, written only through its
methods (pure: no processes)."""

from __future__ import annotations

import time

from infini_notebook.core.rankbook import RankBook
from infini_notebook.core.state import RankState


def book_of(n: int) -> RankBook:
    book = RankBook()
    book.record(
        [
            RankState(rank=r, pid=100 + r, host="h", device="cpu", device_name="cpu", state="idle")
            for r in range(n)
        ]
    )
    return book


def states(rows) -> list[str]:
    return [rs.state for rs in rows]


def snapshot(book: RankBook, alive=lambda r: True, stuck=frozenset(), running=True, **kw):
    return book.snapshot(running, alive, set(stuck), kw.get("telemetry", {}), lambda r: -9)


def test_busy_ranks_show_busy_and_idle_time_counts_from_the_last_busy_moment():
    book = book_of(3)
    book.set_busy([0, 2], True)
    assert book.busy() == {0, 2} and book.idle_for() == 0.0
    assert states(snapshot(book)) == ["busy", "idle", "busy"]
    book.set_busy([0, 2], False)
    time.sleep(0.05)
    assert 0.04 < book.idle_for() < 5


def test_a_failed_rank_shows_error_until_a_cell_works_on_it():
    book = book_of(2)
    book.cell_ended([0, 1], failed=[1])
    assert states(snapshot(book)) == ["idle", "failed"]
    book.cell_ended([0], failed=())  # a cell on rank 0 only: rank 1 keeps its error
    assert states(snapshot(book)) == ["idle", "failed"]
    book.cell_ended([0, 1], failed=())
    assert states(snapshot(book)) == ["idle", "idle"]


def test_a_rank_that_ran_a_failing_cell_through_loses_its_old_note():
    """Rank 1 failed a cell, the rebuild worked (a note on its tile); in the next cell rank 0
    fails and rank 1 runs through: its tile no longer speaks of the old failure."""
    book = book_of(2)
    book.cell_ended([0, 1], failed={1: "ValueError: boom"})
    book.groups_rebuilt()
    assert snapshot(book)[1].note == "last cell failed: ValueError: boom"
    book.cell_ended([0, 1], failed={0: "RuntimeError: timed out"})
    rows = snapshot(book)
    assert states(rows) == ["failed", "idle"] and rows[1].note == ""


def test_stuck_ranks_add_up_and_go_once_their_engine_is_free():
    book = book_of(4)
    book.add_stuck([1])
    book.add_stuck([3])  # a second interrupt adds to the first, never replaces it
    assert book.stuck() == {1, 3}
    assert book.stuck(running=lambda: [3]) == {3}  # rank 1's queue drained
    assert book.stuck(running=lambda: 1 / 0) == {3}  # asking failed: keep what we know
    book.restarted(hard=False)
    assert book.stuck() == {3}  # new groups do not free a rank stuck in native code
    book.restarted(hard=True)
    assert book.stuck() == set()


def test_states_in_order_of_precedence_and_exit_code_once():
    book = book_of(5)
    book.set_busy([1, 2], True)
    book.cell_ended([3], failed=[3])
    rows = snapshot(book, alive=lambda r: r != 0, stuck={2})
    assert states(rows) == ["died", "busy", "stuck", "failed", "idle"]
    assert rows[0].exit_code == -9
    assert states(snapshot(book, running=False)) == ["stopped"] * 5


def test_telemetry_lands_on_the_rows():
    book = book_of(2)
    rows = snapshot(book, telemetry={1: {"rss": 123}})
    assert rows[1].rss == 123


def test_a_kept_status_row_does_not_change_under_a_later_one():
    """``before = session.status()`` then a later status: comparing them must show the
    change (the GPU memory test compared a row with itself before rows were copies)."""
    book = book_of(1)
    (before,) = snapshot(book, telemetry={0: {"memory_used": 100}})
    book.set_busy([0], True)
    (after,) = snapshot(book, telemetry={0: {"memory_used": 300}})
    assert (before.state, before.memory_used) == ("idle", 100)
    assert (after.state, after.memory_used) == ("busy", 300)


def test_failed_and_released_ranks_then_a_rebuild_that_worked_leave_idle_ranks_with_notes():
    book = book_of(4)
    book.cell_ended(
        range(4), failed={1: "ValueError: boom"}, released={0: "was waiting for rank 1"}
    )
    rows = snapshot(book)
    assert states(rows) == ["released", "failed", "idle", "idle"]
    assert rows[1].note == "ValueError: boom" and rows[0].note == "was waiting for rank 1"
    assert book.session_line() == "ready"
    book.groups_rebuilt()
    rows = snapshot(book)
    assert states(rows) == ["idle"] * 4
    assert rows[1].note == "last cell failed: ValueError: boom"
    assert rows[0].note == "last cell released (was waiting for rank 1)"
    assert book.session_line() == "rebuilt after a failure on rank 1, variables kept"
    book.cell_ended([0, 1], failed=())  # a cell that works on them: the notes go
    assert [r.note for r in snapshot(book)] == [""] * 4 and book.session_line() == "ready"


def test_groups_not_whole_name_the_fix_until_a_restart_and_death_comes_first():
    book = book_of(3)
    book.groups_broken("a collective timed out", "%dist_restart")
    assert book.broken() == ("a collective timed out", "%dist_restart")
    assert book.session_line() == "needs %dist_restart: a collective timed out"
    assert book.session_line(died=[2]) == "needs %dist_restart --ranks 2 (or --hard): rank 2 died"
    book.restarted(hard=False)
    assert book.broken() is None and book.session_line() == "ready"
    assert "stuck" in book.session_line(stuck=[1])
