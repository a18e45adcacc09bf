"""A kept session's cells that the kernel which ran them did not see end (issue 48): one that
ends while no kernel is attached keeps its whole output, is named at the attach, becomes
``session.last`` and is code in %dist_export; one still running at the next %%dist is named
with the advice that fits it (%dist_interrupt, never --hard). Real kernels through
jupyter_client, as conftest.py starts them."""

from __future__ import annotations

import os
import re
import secrets
import signal
import time

import psutil
import pytest
from conftest import fresh_kernel, text_of
from jupyter_core.utils import run_sync

pytestmark = pytest.mark.timeout(600)

TICKS = 30

# The cell the kernel dies in: timestamped ticks, a file once ticking (so that the kernel
# dies mid-cell) and one at its end (so that the test knows it ended with no kernel).
TICKING = """\
%%dist
import time
for i in range({ticks}):
    print('tick', i, time.time(), flush=True)
    if i == 5:
        open(f'{mark}mid{{rank}}', 'w').close()
    time.sleep(0.1)
y = x * 2
open(f'{mark}end{{rank}}', 'w').close()"""

# The cell Jupyter's restart interrupts (the kernel records it as failed) and that goes on.
TOCKING = """\
%%dist
import time
for i in range(20):
    print('tock', i, flush=True)
    if i == 5:
        open(f'{mark}tmid{{rank}}', 'w').close()
    time.sleep(0.1)
z = y + 1
open(f'{mark}tend{{rank}}', 'w').close()"""

# A cell left running: a Python loop an interrupt stops.
LOOPING = """\
%%dist
import time
open(f'{mark}loop{{rank}}', 'w').close()
while True:
    time.sleep(0.05)"""


def wait_for_files(*paths: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        assert time.monotonic() < deadline, [p for p in paths if not os.path.exists(p)]
        time.sleep(0.05)


def kill_kernel(cells) -> None:
    """SIGKILL the kernel (as the OOM killer would), then Jupyter's restart of the dead
    kernel, and the extension loaded in the new one."""
    kernel = psutil.Process(cells.kernel_pid)
    kernel.send_signal(signal.SIGKILL)
    kernel.wait(10)
    run_sync(cells.client.km.restart_kernel)(now=True)
    run_sync(cells.client.kc.wait_for_ready)(timeout=60)
    cells.run("%load_ext infini_notebook")


def next_number(cells) -> int:
    """The kernel's number for the next cell (IPython counts a cell as it starts it)."""
    return int(text_of(cells.run("print(get_ipython().execution_count)")))


def ticks_in(path: str) -> list[int]:
    text = open(path).read()
    return [int(w[1]) for w in map(str.split, text.splitlines()) if w[:1] == ["tick"]]


def test_a_cell_that_ends_while_detached_is_kept_named_and_exported_and_a_left_one_advised():
    name = f"ko-{secrets.token_hex(3)}"
    with fresh_kernel() as cells:
        cells.run(f"%dist_start --nprocs 2 --name {name} --keep 2m", timeout=180)
        folder = text_of(cells.run("print(dist_session.folder.path)")).strip()
        mark = os.path.join(folder, "m-")
        cells.run("%%dist\nx = rank + 1")

        # the kernel dies in the middle of the cell; the cell ends while none is attached
        number = next_number(cells)
        cells.client.kc.execute(TICKING.format(ticks=TICKS, mark=mark))
        wait_for_files(f"{mark}mid0", f"{mark}mid1")
        kill_kernel(cells)
        wait_for_files(f"{mark}end0", f"{mark}end1")
        said = text_of(cells.run(f"%dist_attach {name}"))
        line = said.splitlines()[0]
        assert re.search(
            rf"In\[{number}\] finished ok on ranks 0-1 at \d\d:\d\d:\d\d while no kernel was "
            r"attached \(session.last; its output's last lines below, all of it in ",
            line,
        ), said
        assert "still runs" not in said and "Traceback" not in said, said
        for r in (0, 1):  # the tail under the line, each rank's last tick
            assert re.search(rf"^\[rank {r}\] tick {TICKS - 1} \d", said, re.M), said
        # every tick, from the cell's start (before the kernel died too), in the rank files
        for r in (0, 1):
            ticks = ticks_in(os.path.join(folder, "output", f"rank{r}.stdout"))
            assert sorted(set(ticks)) == list(range(TICKS)), ticks
        last = text_of(
            cells.run(
                "r = dist_session.last\n"
                "print(r.ranks, r.errors, [r.stdout[k].count('tick') for k in r.ranks])"
            )
        )
        assert last.strip() == f"[0, 1] {{}} [{TICKS}, {TICKS}]", last
        assert "[rank 1] 4" in text_of(cells.run("%%dist\nprint(y)"))  # it ran through
        script = os.path.join(folder, "exported.py")
        cells.run(f"%dist_export {script}")
        text = open(script).read()
        assert f"for i in range({TICKS}):" in text and "\ny = x * 2" in text, text
        assert "failed in the notebook" not in text, text

        # Jupyter's restart interrupts the kernel first: its cell is recorded as failed, then
        # it ends ok with no kernel, and is code in the export all the same
        number = next_number(cells)
        cells.client.kc.execute(TOCKING.format(mark=mark))
        wait_for_files(f"{mark}tmid0", f"{mark}tmid1")
        run_sync(cells.client.km.restart_kernel)(now=False)
        run_sync(cells.client.kc.wait_for_ready)(timeout=60)
        cells.run("%load_ext infini_notebook")
        wait_for_files(f"{mark}tend0", f"{mark}tend1")
        history = open(os.path.join(folder, "history.jsonl")).read().splitlines()
        assert "z = y + 1" in history[-1] and '"ok": false' in history[-1], history[-1]
        said = text_of(cells.run(f"%dist_attach {name}"))
        assert f"In[{number}] finished ok on ranks 0-1" in said, said
        assert re.search(r"^\[ranks 0-1\] tock 19$", said, re.M), said  # the same: once
        cells.run(f"%dist_export -f {script}")
        text = open(script).read()
        assert "\nz = y + 1" in text and "failed in the notebook" not in text, text
        assert "[rank 1] 5" in text_of(cells.run("%%dist\nprint(z)"))

        # a cell left running by the killed kernel: %%dist names it, with %dist_interrupt
        number = next_number(cells)
        cells.client.kc.execute(LOOPING.format(mark=mark))
        wait_for_files(f"{mark}loop0", f"{mark}loop1")
        kill_kernel(cells)
        said = text_of(cells.run(f"%dist_attach {name}"))
        assert f"In[{number}] still runs on ranks 0-1" in said, said
        refused = text_of(cells.run("%%dist\nprint(x)", allow_error=True))
        advice = f"In[{number}] from the earlier kernel still runs on ranks 0-1; %dist_interrupt"
        assert advice in refused and "--hard" not in refused, refused
        assert "Traceback" not in refused, refused
        status = text_of(cells.run("%dist_status"))  # its session line says the same
        assert advice in status and "--hard" not in status, status
        assert "Interrupted ranks [0, 1]" in text_of(cells.run("%dist_interrupt"))
        deadline = time.monotonic() + 30
        while "[rank 1] 2" not in (out := text_of(cells.run("%%dist\nprint(x)", allow_error=True))):
            assert time.monotonic() < deadline, out
            time.sleep(0.2)
        cells.run("%dist_stop")


class _Keeper:
    """The history a kept session's Keeper keeps, in memory."""

    def __init__(self, cells):
        self.cells = [list(c) for c in cells]

    def history(self):
        from infini_notebook.core.export import HistoryCell

        return [HistoryCell(n, src, ok) for n, (src, ok) in enumerate(self.cells, 1)]

    def mark_ok(self, number):
        self.cells[number - 1][1] = True

    def record_cell(self, source, ok):
        self.cells.append([source, ok])


def test_a_cell_that_ended_unseen_goes_into_the_history_once():
    from types import SimpleNamespace

    from infini_notebook.kernel.left_output import _recorded

    def after(cells, ranks=(0, 1)):
        s = SimpleNamespace(keeper=_Keeper(cells), world_size=2)
        _recorded(s, list(ranks), "step()\n")
        return s.keeper.cells

    # Jupyter's restart interrupted it: the kernel recorded it as failed
    assert after([["%%dist\nstep()", False], ["%dist_attach t", True]])[0] == [
        "%%dist\nstep()",
        True,
    ]
    # a killed kernel never recorded it; an earlier run of the same code is another run
    assert after([["%%dist\nstep()", True], ["x = 1", True]])[-1] == ["%%dist\nstep()\n", True]
    assert after([["%%dist\nother()", False]], ranks=[1])[-1] == [
        "%%dist --ranks 1\nstep()\n",
        True,
    ]
    # a --background cell is recorded (as succeeded) when it starts
    background = [["%%dist --background\nstep()", True], ["%dist_status", True]]
    assert after(background) == background
    # a failed run before a cell that worked is not this one
    cells = [["%%dist\nstep()", False], ["%%dist\nother()", True]]
    assert after(cells) == [*cells, ["%%dist\nstep()\n", True]]
