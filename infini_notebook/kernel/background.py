"""The --background cell: one at a time, run on a thread so the notebook stays free (for
%dist_stacks, %dist_status) while the ranks work. :class:`BackgroundCell` is the only writer
of which cell that is, on which ranks, and whether it was told to stop."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ..core.errors import DistCellError, DistUsageError
from ..core.output import one_line
from ..core.ranks import parse_ranks, rank_label
from . import execution, supervision
from .printers import Printer


@dataclass
class _Running:
    thread: threading.Thread
    ranks: list[int]
    interrupted: bool = False


class BackgroundCell:
    def __init__(self):
        self._running: _Running | None = None

    def current(self) -> _Running | None:
        bg = self._running
        return bg if bg is not None and bg.thread.is_alive() else None

    def refuse(self, what: str, unless_interrupted: bool = False) -> None:
        """One background cell owns its ranks until it ends: anything else sent to the
        engines would queue behind it (or, for a Stop button, interrupt it)."""
        bg = self.current()
        if bg is None or threading.current_thread() is bg.thread:
            return
        if unless_interrupted and bg.interrupted:
            return
        raise DistUsageError(
            f"{what}: a background cell is running on {rank_label(bg.ranks)[1:-1]}; wait for "
            "it, or stop it with %dist_interrupt."
        )

    def start(
        self,
        s,
        code: str,
        ranks: str | list[int] | None = None,
        *,
        printer: Printer,
        where: str | dict | None = None,
        on_end: Callable | None = None,
        **kw,
    ) -> threading.Thread:
        """``execution.run`` on a thread. Output and errors go to ``printer``; the result to
        ``session.last``. Other cells (and pull, push, bench, restart) are refused until it
        ends; ``stacks`` and ``status`` work beside it, ``interrupt`` stops it. ``on_end(result,
        error)``, called on the thread as it ends: the cell's CellResult (a failed cell's too)
        and the exception it ended with, or None (the MCP server's handles, infini_notebook/mcp)."""
        s.require_running()
        self.refuse("%%dist --background")
        targets = execution.resolve_targets(s, ranks, where)  # refuse a bad spec now
        collapse, max_lines = kw.get("collapse", False), kw.get("max_lines")

        def work() -> None:
            result, error, before = None, None, s.last
            try:
                result = execution.run(s, code, targets, collapse, max_lines, printer)
            except DistCellError as e:
                # execution.run makes a cell that ran the last before raising its error
                result, error = (s.last if s.last is not before else None), e
                printer.err(f"{e.report}DistCellError: {e.summary}\n")
            except DistUsageError as e:
                error = e
                printer.err(f"DistUsageError: {e}\n")
            except Exception as e:  # the session stopped under it, say
                error = e
                printer.err(f"The background cell ended: {one_line(e)}\n")
            finally:
                if on_end is not None:
                    on_end(result, error)

        thread = threading.Thread(target=work, name="infini-background-cell", daemon=True)
        self._running = _Running(thread, targets)
        thread.start()
        return thread

    def interrupt(self, s, ranks: str | list[int] | None = None) -> list[int]:
        """SIGINT the background cell's ranks that still run it (of ``ranks``): stops it
        and nothing else. Returns the ranks signalled."""
        bg = self.current()
        if bg is None:
            return []
        bg.interrupted = True
        busy = s.book.busy()
        chosen = parse_ranks(ranks, s.world_size) if ranks is not None else bg.ranks
        targets = [r for r in chosen if r in busy and r in bg.ranks]
        supervision.send_signal(s, signal.SIGINT, targets)
        return targets

    def join(self, timeout: float | None = None) -> None:
        """Wait for the background cell's thread (if one runs) to end."""
        bg = self._running
        if bg is not None:
            bg.thread.join(timeout)
