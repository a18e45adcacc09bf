"""The two exception types users meet.

Both render as a short message in IPython (``_render_traceback_``), not a kernel-side
traceback: the interesting frames live on the ranks, not in our plumbing.
"""

from __future__ import annotations

import re

# Where a summary's parts meet: "; " between causes, and the sentence of advice after them.
_PARTS = re.compile(r"; |(?<=\.) (?=[A-Z%])")


class DistUsageError(Exception):
    """A user mistake (bad flag, wrong state). The message names the fix."""

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[0;31mDistUsageError\x1b[0m: {self}"]


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
        error's own line, short enough not to wrap, and each further part on a line below."""
        lines = self.report.splitlines() if self.report else []
        head, *rest = _PARTS.split(self.summary)
        return lines + [f"\x1b[0;31mDistCellError\x1b[0m: {head}"] + [f"  {p}" for p in rest]


class DistInterrupted(DistCellError):
    """The user stopped a running cell (Jupyter's stop button, Ctrl-C)."""

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[0;31mKeyboardInterrupt\x1b[0m: {self.summary}"]
