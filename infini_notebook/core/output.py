"""Turn what the ranks print into labeled notebook output. Pure: text in, text out.

Ranks' stdout/stderr arrive as pieces (one per iopub message). :class:`StreamLabeler` keeps
each rank's unfinished line and hands back only complete lines, each prefixed with its rank,
capped per rank so that a rank printing a million lines cannot freeze the notebook. A line
rewritten with carriage returns (``\r``: progress lines, tqdm's text bar) is a *live* line:
``live()`` gives each rank's current one, for a display updated in place, and only its final
state becomes a line of the stream.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .ranks import rank_label

DEFAULT_MAX_LINES = 2000
# What a rank wrote outside its cell is shown at the start of its next cell, each line marked
# (engine/output_streams.py); text a widget's callback wrote and the rank showed under that
# widget at once is marked apart: the kernel keeps it in the rank's file, and shows it no more.
LATE = "(late) "
LATE_SHOWN = "(late, shown under its widget) "


@dataclass
class OpenLine:
    """A line not ended by a newline yet, as Jupyter shows one process's stream: text after
    a carriage return replaces the line (a bare ``\r`` at the end waits for that text)."""

    text: str = ""
    returned: bool = False  # a \r came: the next text starts the line afresh
    live: bool = False  # it was rewritten at least once (a progress line)

    def write(self, chunk: str) -> None:
        """Add text holding no newline. Linear in the chunk: of many rewrites in one chunk
        (a progress bar's updates), only the last that holds text matters."""
        head, returned, rest = chunk.partition("\r")
        if head:
            if self.returned:
                self.text, self.returned = head, False
            else:
                self.text += head
        if not returned:
            return
        self.live = True
        parts = rest.split("\r")
        if parts[-1]:
            self.text, self.returned = parts[-1], False
            return
        self.returned = True
        for part in reversed(parts[:-1]):
            if part:
                self.text = part
                break


def settle(text: str) -> str:
    """``text`` with each line's carriage returns applied: what a reader sees at the end."""
    if "\r" not in text:
        return text
    lines = text.split("\n")
    for i, raw in enumerate(lines):
        if "\r" in raw:
            line = OpenLine()
            line.write(raw)
            lines[i] = line.text
    return "\n".join(lines)


@dataclass
class StreamLabeler:
    """Incremental, per-rank line labeling for one cell."""

    collapse: bool = False  # show identical chunks from several ranks once
    max_lines: int = DEFAULT_MAX_LINES  # per rank and stream, per cell
    _open: dict = field(default_factory=dict)  # (rank, stream) -> OpenLine
    _lines: dict = field(default_factory=dict)  # (rank, stream) -> lines shown
    capped: set = field(default_factory=set)  # (rank, stream) that hit max_lines

    # Where each rank's whole text is, for the cap message: {(rank, stream): path}
    full_text_at: dict = field(default_factory=dict)

    def feed(self, stream: str, new: dict[int, str], final: bool = False) -> str:
        """Given the text each rank wrote since the last call, return the labeled complete
        lines not shown yet. ``final`` also ends unfinished lines (the cell is over); give
        it every rank then, with "" for those that wrote nothing new."""
        fresh = {r: self.complete(r, stream, new[r] or "", final) for r in sorted(new)}
        return self._label({r: text for r, text in fresh.items() if text})

    def complete(self, rank: int, stream: str, text: str, final: bool = False) -> str:
        """The complete lines (unlabeled, capped) that ``text`` ends for one rank's stream;
        ``final`` also ends its unfinished line."""
        key = (rank, stream)
        if key in self.capped:  # nothing more is shown this cell: the file has it all
            return ""
        done = self._complete_lines(key, text)
        line = self._open.get(key)
        if final and line is not None:
            if line.text:
                done.append(line.text)
            del self._open[key]
        return self._cap(key, "".join(f"{t}\n" for t in done))

    def reset(self, rank: int) -> None:
        """The rank cleared its output (``clear_output``): what it shows from now on counts
        toward the cap afresh, so a loop that clears and prints ends showing its last line."""
        for stream in ("stdout", "stderr"):
            self.capped.discard((rank, stream))
            self._lines.pop((rank, stream), None)
            self._open.pop((rank, stream), None)  # an unfinished line is cleared too

    def live(self) -> str:
        """The unfinished lines being rewritten in place (progress lines), labeled, one per
        rank and stream: what a display updated in place shows while the cell runs."""
        current = {}
        for (rank, stream), line in sorted(self._open.items()):
            if line.live and line.text and (rank, stream) not in self.capped:
                current[rank] = current.get(rank, "") + line.text + "\n"
        return self._label(current)

    def _complete_lines(self, key: tuple, text: str) -> list[str]:
        """Write ``text`` into the rank's open line; return the lines it ended."""
        parts = text.split("\n")
        if "\r" not in text and key not in self._open:  # plain lines: nothing to apply
            if parts[-1]:
                self._open[key] = OpenLine(parts[-1])
            return parts[:-1]
        done = []
        for part in parts[:-1]:
            line = self._open.pop(key, None) or OpenLine()
            line.write(part)
            done.append(line.text)
        if parts[-1]:
            self._open.setdefault(key, OpenLine()).write(parts[-1])
        return done

    def _cap(self, key: tuple, text: str) -> str:
        if not text or key in self.capped:
            return ""
        lines = text.splitlines(keepends=True)
        shown = self._lines.get(key, 0)
        room = self.max_lines - shown
        if len(lines) <= room:
            self._lines[key] = shown + len(lines)
            return text
        self.capped.add(key)
        self._lines[key] = self.max_lines
        rank, stream = key
        kept = "".join(lines[:room])
        if kept and not kept.endswith("\n"):
            kept += "\n"
        where = self.full_text_at.get(key) or f"session.last.{stream}[{rank}] (its last MB)"
        return kept + (
            f"... {stream} capped at {self.max_lines} lines for this cell; every line is in "
            f"{where} (raise the cap with %%dist --max-lines N)\n"
        )

    def _label(self, fresh: dict[int, str]) -> str:
        if not fresh:
            return ""
        groups = group_identical(fresh) if self.collapse else [([r], t) for r, t in fresh.items()]
        return "".join(prefix_lines(rank_label(ranks), text) for ranks, text in groups)


def prefix_lines(label: str, text: str) -> str:
    """Prefix every line of ``text`` with ``label``; the result ends with a newline."""
    lines = text.splitlines() or [""]
    return "".join(f"{label} {line}\n" for line in lines)


def group_identical(by_rank: dict[int, str]) -> list[tuple[list[int], str]]:
    """Group ranks whose text is identical, ordered by the lowest rank of each group."""
    groups: dict[str, list[int]] = {}
    for rank in sorted(by_rank):
        groups.setdefault(by_rank[rank], []).append(rank)
    return sorted(((ranks, text) for text, ranks in groups.items()), key=lambda g: g[0][0])


_CELL_COUNT = re.compile(r"In\s*\[\d+\]")


def error_report(tracebacks: dict[int, str]) -> str:
    """Labeled tracebacks; identical ones are shown once with all their ranks.

    Ranks that ran different numbers of cells number them differently (``In[5]``), which
    does not make their tracebacks different."""
    normalized = {r: _CELL_COUNT.sub("In[ ]", tb) for r, tb in tracebacks.items()}
    parts = []
    for ranks, _ in group_identical(normalized):
        parts.append(f"{rank_label(ranks)}\n{tracebacks[ranks[0]].rstrip()}\n")
    return "".join(parts)


def merge_told(told: dict[int, str], failed: dict[int, str]) -> dict[int, tuple[int, ...]]:
    """Tracebacks shown as they came (``told``: rank -> traceback, while other ranks still
    ran) with the identical ones of other ``failed`` ranks: the rank whose note stays ->
    every rank it now stands for, so that a traceback is shown once (a SyntaxError on 8
    ranks came as a few notes and again in the cell's error). Ranks not named stay apart."""
    groups: dict[str, list[int]] = {}
    for r in sorted(told):
        groups.setdefault(_CELL_COUNT.sub("In[ ]", told[r]), []).append(r)
    for r in sorted(failed):
        key = _CELL_COUNT.sub("In[ ]", failed[r])
        if r not in told and key in groups:
            groups[key].append(r)
    return {ranks[0]: tuple(sorted(ranks)) for ranks in groups.values()}


def error_summary(errors: dict[int, str], all_ranks: list[int]) -> str:
    """One line: which ranks failed with what, and which did not."""
    by_error = group_identical(errors)
    what = "; ".join(f"{rank_label(r)[1:-1]}: {e}" for r, e in by_error)
    ok = [r for r in all_ranks if r not in errors]
    tail = f" ({rank_label(ok)[1:-1]} finished)" if ok else ""
    return f"{what}{tail}"


def rank_values_repr(values: dict, width: int = 120) -> str:
    """``{rank: value}`` shown one short line per rank: big lists, strings and tensors are
    cut (reprlib), so showing what %dist_pull returned cannot flood the notebook."""
    import reprlib

    short = reprlib.Repr()
    short.maxlist = short.maxtuple = short.maxdict = short.maxset = 8
    short.maxstring = short.maxother = width
    lines = []
    for rank, value in values.items():
        text = " ".join(short.repr(value).split())  # multi-line reprs (tensors) on one line
        if len(text) > width:
            text = text[: width - 3] + "..."
        lines.append(f"{rank!r}: {text}")
    return "{" + ",\n ".join(lines) + "}"


def main_thread_stack(dump: str) -> str:
    """From a faulthandler dump of every thread, the block of the thread that runs the cell
    (the one faulthandler calls 'Current thread', else the longest)."""
    blocks = [b for b in dump.strip().split("\n\n") if b.strip()]
    if not blocks:
        return dump
    current = [b for b in blocks if b.lstrip().startswith("Current thread")]
    block = (current or sorted(blocks, key=len))[-1]
    # Most recent call first: the frames below IPython's run_code are engine plumbing.
    lines = block.splitlines()
    for i, line in enumerate(lines):
        if "IPython/core/interactiveshell.py" in line:
            return "\n".join(lines[:i])
    frames = [line for line in lines if line.lstrip().startswith("File ")]
    if frames and "selectors.py" in frames[0]:  # most recent call: waiting for a message
        return "idle: no cell running (waiting in the engine's event loop)"
    return block


class RankValues(dict):
    """``{rank: value}``, as ``%dist_pull`` returns it: a dict whose notebook display shows
    one short line per rank, so a bare ``%dist_pull big`` does not flood the page."""

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(rank_values_repr(self))


_SOURCE_PREFIX = re.compile(r"^\[[^\]]+\.(?:cc|cpp|h|hpp):\d+\]\s*")


def left_debugger(e: BaseException) -> bool:
    """The user ended a rank's debugger (pdb's q, or Stop at its prompt): no traceback."""
    return getattr(e, "ename", type(e).__name__) == "BdbQuit"


def one_line(e: BaseException) -> str:
    ename = getattr(e, "ename", type(e).__name__)
    evalue = _SOURCE_PREFIX.sub("", str(getattr(e, "evalue", str(e))).strip())
    first = str(evalue).strip().splitlines()[0] if str(evalue).strip() else ""
    if left_debugger(e):
        return f"left the debugger ({first or 'q'})"
    return f"{ename}: {first}" if first else ename


def remote_traceback(e: BaseException) -> str:
    tb = getattr(e, "traceback", None)
    if isinstance(tb, str) and tb.strip():
        return tb
    render = getattr(e, "render_traceback", None)
    if render is not None:
        try:
            return "\n".join(render())
        except Exception:
            pass
    return one_line(e)
