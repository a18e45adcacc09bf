"""Each rank's output in one cell, in the order that rank produced it, and the cell's output
rendered from it once the cell ends: in rank order, the same on every run, whatever order
the ranks' messages arrived in. Pure: lines and output dicts in, items out.

A rank's ``clear_output`` empties its own part (with ``wait``, at its next output, as
Jupyter does) and ``update_display`` replaces one of its displays, so a live plot on 4 ranks
ends as 4 figures. Rendering merges what reads the same on several ranks:

- always, an identical warning (the warning line and the source lines under it): every rank
  names its cell the same way (engine/cell_names.py), so it is one block ``[ranks 0-3]``;
- with ``collapse``, any identical line (or display) at the same place in each rank's output.

Figures (PNG or SVG displays) from two or more ranks are shown together once the cell ends:
one "figures" item, in rank order, where the first of them was (4 ranks' plots stacked
1,800 px tall before).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# A line Python's warnings module starts a warning with: "In[7]:2: FutureWarning: ..."
WARNING_LINE = re.compile(r"^\S.*:\d+: \w*Warning: ")
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
        """Everything to show, in rank order (or, with ``collapse``, place by place); with
        ``figures_together``, the figures of several ranks as one "figures" item whose
        payload is ``[(rank, output), ...]``."""
        items = self._collapsed() if collapse else self._in_rank_order()
        return _figures_together(items) if figures_together else items

    def _in_rank_order(self) -> list[Item]:
        holders = self._warning_holders()
        items: list[Item] = []
        for rank in sorted(self._entries):
            entries = self._entries[rank]
            i = 0
            while i < len(entries):
                block = _warning_block(entries, i)
                if block:
                    ranks = holders[block]
                    if rank == ranks[0]:
                        items.extend(Item(ranks, "stderr", line) for line in block)
                    i += len(block)
                    continue
                kind, payload = entries[i]
                items.append(Item((rank,), kind, payload))
                i += 1
        return items

    def _warning_holders(self) -> dict[tuple[str, ...], tuple[int, ...]]:
        holders: dict[tuple[str, ...], list[int]] = {}
        for rank in sorted(self._entries):
            entries = self._entries[rank]
            for i in range(len(entries)):
                block = _warning_block(entries, i)
                if block and rank not in holders.setdefault(block, []):
                    holders[block].append(rank)
        return {block: tuple(ranks) for block, ranks in holders.items()}

    def _collapsed(self) -> list[Item]:
        items: list[Item] = []
        longest = max((len(e) for e in self._entries.values()), default=0)
        for place in range(longest):
            groups: dict[tuple, list[int]] = {}
            shown: dict[tuple, tuple[str, Any]] = {}
            for rank in sorted(self._entries):
                if place < len(self._entries[rank]):
                    kind, payload = self._entries[rank][place]
                    key = (kind, _key(payload))
                    groups.setdefault(key, []).append(rank)
                    shown.setdefault(key, (kind, payload))
            for key, ranks in groups.items():  # ordered by their lowest rank
                items.append(Item(tuple(ranks), *shown[key]))
        return items


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


def _warning_block(entries: list[tuple[str, Any]], i: int) -> tuple[str, ...] | None:
    """The warning starting at ``entries[i]``: its line and the indented source lines."""
    kind, line = entries[i]
    if kind != "stderr" or not WARNING_LINE.match(line):
        return None
    end = i + 1
    while end < len(entries) and entries[end][0] == "stderr" and entries[end][1][:1].isspace():
        end += 1
    return tuple(text for _, text in entries[i:end])


def _display_id(output: dict) -> str | None:
    return (output.get("transient") or {}).get("display_id")


def _key(payload: Any) -> Any:
    if isinstance(payload, dict):  # a display: identical when its data is
        return json.dumps(payload.get("data"), sort_keys=True, default=str)
    return payload
