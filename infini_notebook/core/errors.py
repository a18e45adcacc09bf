"""The two exception types users meet.

Both render as a short message in IPython (``_render_traceback_``), not a kernel-side
traceback: the interesting frames live on the ranks, not in our plumbing.
"""

from __future__ import annotations

import re

# Where a summary's parts meet: "; " between causes, and the sentence of advice after them
# (so a sentence of advice holds no "; ": it would be cut in two lines).
_PARTS = re.compile(r"; |(?<=\.) (?=[A-Z%])")
# No line is wrapped at a width of ours: JupyterLab wraps output lines at the notebook's
# width (``word-break: break-all``), and lines we had broken at 100 columns were broken
# again in a narrower notebook ("re-cre" / "ate"). Each part of a message gets its own line.


def headline(name: str, text: str) -> str:
    """``name: text`` with the name in red, on one line."""
    return f"\x1b[0;31m{name}\x1b[0m: {text}"


class DistUsageError(Exception):
    """A user mistake (bad flag, wrong state). The message names the fix."""

    def _render_traceback_(self) -> list[str]:
        return [headline("DistUsageError", str(self))]


class DistCellError(Exception):
    """Code failed on one or more ranks. ``report`` holds the labeled tracebacks."""

    def __init__(self, summary: str, report: str = "", ranks: list[int] | None = None):
        super().__init__(summary)
        self.summary = summary
        self.report = report
        self.ranks = ranks or []

    def __str__(self) -> str:
        return f"{self.summary}\n{self.report}" if self.report else self.summary

    def _render_traceback_(self) -> list[str]:
        """The labeled tracebacks, then the summary: its first part (the root cause) on the
        error's own line, and each further part on a line below, indented."""
        lines = self.report.splitlines() if self.report else []
        head, *rest = _PARTS.split(self.summary)
        return [*lines, headline("DistCellError", head), *(f"  {part}" for part in rest)]


class DistInterrupted(DistCellError):
    """The user stopped a running cell (Jupyter's stop button, Ctrl-C)."""

    def _render_traceback_(self) -> list[str]:
        return [headline("KeyboardInterrupt", self.summary)]
