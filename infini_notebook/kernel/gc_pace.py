"""Python's cyclic garbage collector paced to a cell's size while the cell runs. A cell on N
ranks makes tens of container objects per rank (ipyparallel's request, future, metadata and
reply for each rank), and the collector's young generation is scanned every 700 new
objects by default: at 768 simulated ranks collections were a third of the kernel's CPU
per cell (719 ms; 496 ms with a threshold of 20,000; 435 ms with the collector off;
benchmarks/bench_scale.py, docs/scale.md). So while a cell runs, the threshold grows with
its ranks, and is put back when the last running cell ends (a --background cell's thread
may overlap the foreground one). Reference counting still frees everything that is not
in a cycle at once; cycles wait a little longer. A threshold the user set higher is kept."""

from __future__ import annotations

import contextlib
import gc
import threading

PER_RANK = 25  # young objects allowed per rank of the cell before a collection

_lock = threading.Lock()
_running: list[int] = []  # the threshold each running cell asked for
_saved: tuple[int, int, int] | None = None  # the thresholds before the first of them


@contextlib.contextmanager
def paced(ranks: int):
    """While the body runs: the young generation collected every ``PER_RANK * ranks`` new
    objects at most as often (never more often than before)."""
    _begin(PER_RANK * ranks)
    try:
        yield
    finally:
        _end(PER_RANK * ranks)


def _begin(wanted: int) -> None:
    global _saved
    with _lock:
        if not _running:
            _saved = gc.get_threshold()
        _running.append(wanted)
        _apply()


def _end(wanted: int) -> None:
    global _saved
    with _lock:
        _running.remove(wanted)
        if _running:
            _apply()
        elif _saved is not None:
            gc.set_threshold(*_saved)
            _saved = None


def _apply() -> None:
    first, *rest = _saved
    gc.set_threshold(max(first, *_running), *rest)
