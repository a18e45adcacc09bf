"""Where a cell's code sits in the notebook's editor, so that a rank's tracebacks, warnings
and pdb count lines as the editor does. Pure.

A ``%%dist`` cell's body starts on the editor's line 2 (the magic line is line 1), and
IPython drops a cell's leading blank lines before compiling it: a rank counting lines of
the code it got said "line 2" for the editor's line 3. The kernel says where the code
starts in the execute request's label (``In[7]`` when on line 1, ``In[7]:2`` else); the
rank adds its own leading blank lines (engine/cell_names.py).
"""

from __future__ import annotations

import re

_LABEL = re.compile(r"In\[(\d+)\](?::(\d+))?")


def label(name: str, first: int) -> str:
    """The request's label: the cell's name (``In[7]``), and its code's first line if not 1."""
    return f"{name}:{first}" if name and first > 1 else name


def parse(text: str) -> tuple[int, int] | None:
    """``(notebook number, first line)`` from a label, or None for another label."""
    match = _LABEL.fullmatch(text or "")
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2) or 1)


def first_line(raw: str, code: str) -> int:
    """The editor line ``code`` starts on in the notebook cell ``raw``: where it ends the
    cell after blank lines or one cell-magic line (``%%dist --ranks 0``, auto mode's
    whole cell); 1 when it is not such a tail (the API called from a cell's code)."""
    whole, body = raw.rstrip(), code.rstrip()
    if not body.strip() or not whole.endswith(body):
        return 1
    start = len(whole) - len(body)
    before = whole[:start].strip()
    if before and not (before.startswith("%%") and "\n" not in before):
        return 1
    return whole.count("\n", 0, start) + 1


def leading_blank_lines(code: str) -> int:
    """The blank lines IPython drops from a cell's start before compiling it
    (``leading_empty_lines`` in IPython/core/inputtransformer2.py)."""
    lines = code.splitlines()
    for i, line in enumerate(lines):
        if line.strip():
            return i
    return 0
