"""Each rank's output in one cell, in the order that rank produced it, and the cell's output
rendered from it once the cell ends: in rank order, the same on every run, whatever order
the ranks' messages arrived in. Pure: lines and output dicts in, items out.

A rank's ``clear_output`` empties its own part (with ``wait``, at its next output, as
Jupyter does) and ``update_display`` replaces one of its displays, so a live plot on 4 ranks
ends as 4 figures. Rendering merges what reads the same on several ranks:

- always, an identical warning (the warning line and the source lines under it, or a line
  torch's C++ side logs, ``[W1106 10:23:45.123456789 socket.cpp:752] ...``, compared
  without its time) and an identical line written after its cell (``(late) ...``): every
  rank names its cell the same way (engine/cell_names.py), so it is one block
  ``[ranks 0-3]``, whole, at the first rank's place (with ``collapse`` too);
- with ``collapse``, any identical line (or display) at the same step of each rank's output
  (a rank that reaches a merged block first waits there for the others).

Figures (PNG or SVG displays) from two or more ranks are shown together once the cell ends:
one "figures" item, in rank order, where the first of them was (4 ranks' plots stacked
1,800 px tall before).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from .output import LATE

# A line Python's warnings module starts a warning with: "In[7]:2: FutureWarning: ..."
WARNING_LINE = re.compile(r"^\S.*:\d+: \w*Warning: ")
# The start of a line torch's C++ side logs (c10/util/Logging.cpp): severity (info,
# warning, error), date, time: "[W1127 21:12:44.761320144 TCPStore.cpp:340] [c10d] ..."
C10_WARNING = re.compile(r"^\[[IWE]\d{3,4} \d\d:\d\d:\d\d\.\d+ ")
TEXT_KINDS = ("stdout", "stderr")
FIGURE_TYPES = ("image/png", "image/svg+xml")
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
# In a display's metadata: the rank put its label beside the widget (engine/widget_labels.py)
LABELED_WIDGET = "infini_notebook_labeled"


def display_heading(label: str, output: dict) -> str:
    """The line a printer writes above a rank's rich display: its label, unless the rank
    labeled the display itself."""
    if not label or (output.get("metadata") or {}).get(LABELED_WIDGET):
        return ""
    return f"{label}\n"


@dataclass(frozen=True)
class Item:
    """One thing shown: ``ranks`` (whose it is), ``kind`` ("stdout"/"stderr": one line;
    "note": text of the kernel's own about that rank, labeled already; "rich": an output
    dict with "data" and "metadata"; "figures": ``[(rank, output), ...]``, several ranks'
    figures shown together), and the payload."""

    ranks: tuple[int, ...]
    kind: str
    payload: Any


class Transcript:
    """What each rank showed in one cell so far (lines capped upstream by StreamLabeler)."""

    def __init__(self, ranks: list[int]):
        self._entries: dict[int, list[tuple[str, Any]]] = {r: [] for r in ranks}
        self._clear_at_next: set[int] = set()
        self._changed = False  # something shown was cleared or replaced (take_changed)

    def add_text(self, rank: int, stream: str, text: str) -> None:
        """Complete lines (``text`` ends with a newline, or is empty)."""
        if text:
            self._before_output(rank)
            self._entries[rank].extend((stream, line) for line in text.splitlines())

    def add_note(self, rank: int, text: str) -> None:
        self._before_output(rank)
        self._entries[rank].append(("note", text))

    def replace_note(self, rank: int, old: str, new: str | None) -> None:
        """The rank's note ``old`` becomes ``new`` (None: it goes)."""
        entries = self._entries[rank]
        for i, entry in enumerate(entries):
            if entry == ("note", old):
                if new is None:
                    del entries[i]
                else:
                    entries[i] = ("note", new)
                self._changed = True
                return

    def add_rich(self, rank: int, output: dict) -> None:
        self._before_output(rank)
        self._entries[rank].append(("rich", output))

    def clear(self, rank: int, wait: bool) -> None:
        """The rank cleared its output: now, or with ``wait`` at its next output."""
        if wait:
            self._clear_at_next.add(rank)
        else:
            self._drop(rank)

    def update_display(self, rank: int, output: dict) -> None:
        """Replace the rank's displays shown with ``output``'s display id."""
        display_id = _display_id(output)
        for i, (kind, shown) in enumerate(self._entries[rank]):
            if kind == "rich" and display_id is not None and _display_id(shown) == display_id:
                self._entries[rank][i] = ("rich", {**shown, **output})
                self._changed = True

    def take_changed(self) -> bool:
        """Whether something already shown was cleared or replaced since the last call:
        the output must then be shown again (``render``), not only added to."""
        changed, self._changed = self._changed, False
        return changed

    def _before_output(self, rank: int) -> None:
        if rank in self._clear_at_next:
            self._clear_at_next.discard(rank)
            self._drop(rank)

    def _drop(self, rank: int) -> None:
        if self._entries[rank]:
            self._entries[rank] = []
            self._changed = True

    def render(self, collapse: bool = False, figures_together: bool = False) -> list[Item]:
        """Everything to show, in rank order (or, with ``collapse``, step by step); with
        ``figures_together``, the figures of several ranks as one "figures" item whose
        payload is ``[(rank, output), ...]``."""
        items = self._collapsed() if collapse else self._in_rank_order()
        return _figures_together(items) if figures_together else items

    def _in_rank_order(self) -> list[Item]:
        units = self._units()
        holders = _holders(units)
        items: list[Item] = []
        for rank in sorted(units):
            for kind, payload in units[rank]:
                if kind != "block":
                    items.append(Item((rank,), kind, payload))
                elif holders[payload[0]][0] == rank:
                    items.extend(_block_items(holders, *payload))
        return items

    def _collapsed(self) -> list[Item]:
        """Step by step, each rank's next line (or display) merged with the same on other
        ranks. A merged block (a warning, a late line) is shown once, whole, with every
        rank that wrote it: a rank that reaches it first waits there for the others, so
        that on every rank it follows what came before it and precedes what comes after."""
        units = self._units()
        owed = {key: set(ranks) for key, ranks in _holders(units).items()}  # not shown yet
        at = dict.fromkeys(units, 0)  # rank -> its next unit
        items: list[Item] = []
        while True:
            ahead = {r: units[r][i] for r, i in sorted(at.items()) if i < len(units[r])}
            if not ahead:
                return items
            lines = {r: u for r, u in ahead.items() if u[0] != "block"}
            waiting: dict[tuple, list[int]] = {}  # block key -> the ranks at it
            for r, (kind, payload) in ahead.items():
                if kind == "block":
                    waiting.setdefault(payload[0], []).append(r)
            ready = {key: ranks for key, ranks in waiting.items() if set(ranks) == owed[key]}
            if not lines and not ready:  # ranks have blocks in different orders: the lowest
                key = next(iter(waiting))  # rank's goes for the ranks at it, the rest later
                ready[key] = waiting[key]
            items += _merge_lines(lines)
            moved = list(lines)
            for key, ranks in ready.items():
                items += [Item(tuple(ranks), key[0], line) for line in ahead[ranks[0]][1][1]]
                owed[key] -= set(ranks)
                moved += ranks
            for r in moved:
                at[r] += 1

    def _units(self) -> dict[int, list[tuple[str, Any]]]:
        """Each rank's entries, a merged block as one ``("block", (key, lines))``; the key
        counts the block's repeats on the rank, so its second warning merges with the
        other ranks' second, and none is lost."""
        units: dict[int, list[tuple[str, Any]]] = {}
        for rank, entries in self._entries.items():
            mine, repeats, i = [], {}, 0
            while i < len(entries):
                block = _merged_block(entries, i)
                if block is None:
                    mine.append(entries[i])
                    i += 1
                    continue
                key, lines = block
                repeats[key] = repeats.get(key, 0) + 1
                mine.append(("block", ((*key, repeats[key]), lines)))
                i += len(lines)
            units[rank] = mine
        return units


def _holders(units: dict[int, list[tuple[str, Any]]]) -> dict[tuple, tuple[int, ...]]:
    """Each merged block's key -> the ranks that wrote it, lowest first."""
    holders: dict[tuple, list[int]] = {}
    for rank in sorted(units):
        for kind, payload in units[rank]:
            if kind == "block":
                holders.setdefault(payload[0], []).append(rank)
    return {key: tuple(ranks) for key, ranks in holders.items()}


def _merge_lines(ahead: dict[int, tuple[str, Any]]) -> list[Item]:
    """One step's lines (or displays) of several ranks, identical ones merged, ordered by
    their lowest rank."""
    groups: dict[tuple, list[int]] = {}
    shown: dict[tuple, tuple[str, Any]] = {}
    for rank in sorted(ahead):
        kind, payload = ahead[rank]
        key = (kind, _key(payload))
        groups.setdefault(key, []).append(rank)
        shown.setdefault(key, (kind, payload))
    return [Item(tuple(ranks), *shown[key]) for key, ranks in groups.items()]


def _block_items(holders: dict, key: tuple, lines: tuple) -> list[Item]:
    """A merged block's lines, labeled with its ranks (the text is the lowest rank's)."""
    return [Item(holders[key], key[0], line) for line in lines]


def is_figure(output: dict) -> bool:
    return any(t in (output.get("data") or {}) for t in FIGURE_TYPES)


def _figures_together(items: list[Item]) -> list[Item]:
    figures = [(r, i.payload) for i in items if i.kind == "rich" and is_figure(i.payload)
               for r in i.ranks]  # fmt: skip
    if len({r for r, _ in figures}) < 2:
        return items
    together = Item(
        tuple(sorted({r for r, _ in figures})), "figures", sorted(figures, key=lambda f: f[0])
    )
    out: list[Item] = []
    placed = False
    for item in items:
        if not (item.kind == "rich" and is_figure(item.payload)):
            out.append(item)
        elif not placed:  # where the first figure was
            out.append(together)
            placed = True
    return out


def _merged_block(entries: list[tuple[str, Any]], i: int) -> tuple[tuple, tuple] | None:
    """The block starting at ``entries[i]`` that is merged across ranks, as ``(key, lines)``:
    a warning (its line and the indented source lines under it) or a line written after its
    cell; None for any other entry."""
    kind, line = entries[i]
    if kind not in TEXT_KINDS:
        return None
    if line.startswith(LATE):
        return (kind, C10_TIME.sub(r"\1", line)), (line,)
    if kind != "stderr":
        return None
    if C10_WARNING.match(line):
        return (kind, C10_TIME.sub(r"\1", line)), (line,)
    if not WARNING_LINE.match(line):
        return None
    end = i + 1
    while end < len(entries) and entries[end][0] == "stderr" and entries[end][1][:1].isspace():
        end += 1
    lines = tuple(text for _, text in entries[i:end])
    return (kind, *lines), lines


# The time in a C++ warning's start, left out when ranks' warnings are compared
C10_TIME = re.compile(r"^((?:\(late\) )?\[[IWE]\d{3,4}) \d\d:\d\d:\d\d\.\d+")


def _display_id(output: dict) -> str | None:
    return (output.get("transient") or {}).get("display_id")


def _key(payload: Any) -> Any:
    if isinstance(payload, dict):  # a display: identical when its data is
        return json.dumps(payload.get("data"), sort_keys=True, default=str)
    return payload
