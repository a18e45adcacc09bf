"""The two exception types users meet.

Both render as a short message in IPython (``_render_traceback_``), not a kernel-side
traceback: the interesting frames live on the ranks, not in our plumbing.
"""

from __future__ import annotations

import re
import textwrap

# Where a summary's parts meet: "; " between causes, and the sentence of advice after them
# (so a sentence of advice holds no "; ": it would be cut in two lines).
_PARTS = re.compile(r"; |(?<=\.) (?=[A-Z%])")
# The longest line of a message. JupyterLab wraps longer output lines anywhere, mid-word
# too (``word-break: break-all`` on output <pre>), so ours are wrapped between words first.
WIDTH = 100


def wrap(name: str, text: str, indent: str = "  ") -> list[str]:
    """``name: text`` (name in red) in lines of at most WIDTH characters, broken between
    words, continuation lines indented; a word longer than a line is left whole."""
    lines = textwrap.wrap(
        f"{name}: {text}", WIDTH, subsequent_indent=indent,
        break_long_words=False, break_on_hyphens=False,
    )  # fmt: skip
    first = lines[0] if lines else f"{name}:"
    return [f"\x1b[0;31m{name}\x1b[0m{first[len(name) :]}", *lines[1:]]


def wrap_part(text: str) -> list[str]:
    """A further part of a message: indented 2, its continuation lines 4."""
    return textwrap.wrap(
        text, WIDTH, initial_indent="  ", subsequent_indent="    ",
        break_long_words=False, break_on_hyphens=False,
    )  # fmt: skip


class DistUsageError(Exception):
    """A user mistake (bad flag, wrong state). The message names the fix."""

    def _render_traceback_(self) -> list[str]:
        return wrap("DistUsageError", str(self))


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
        error's own line, and each further part on a line below, every line broken between
        words to fit WIDTH (its continuations indented further)."""
        lines = self.report.splitlines() if self.report else []
        head, *rest = _PARTS.split(self.summary)
        lines += wrap("DistCellError", head, "    ")
        for part in rest:
            lines += wrap_part(part)
        return lines


class DistInterrupted(DistCellError):
    """The user stopped a running cell (Jupyter's stop button, Ctrl-C)."""

    def _render_traceback_(self) -> list[str]:
        return wrap("KeyboardInterrupt", self.summary)
