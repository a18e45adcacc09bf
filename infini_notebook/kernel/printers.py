"""Where a cell's labeled output goes: the Printer protocol, and TextPrinter, the running
cell's streams and IPython's display publisher (a line or a display updated in place)."""

from __future__ import annotations

import html
import sys
from typing import Protocol

from ..core.output import prefix_lines
from ..core.ranks import rank_label
from ..core.transcript import TEXT_KINDS, Item, display_heading

# JupyterLab shows text/plain with word-break: break-all, so a long status line (where ranks
# wait) wrapped mid-word; its HTML twin wraps between words, in the output's own font.
STATUS_STYLE = "margin:0;white-space:pre-wrap;word-break:normal;overflow-wrap:break-word"


def status_bundle(text: str) -> dict[str, str]:
    """A status line as a display shows it: text for terminals and saved notebooks' readers,
    HTML that wraps at spaces for the notebook."""
    return {
        "text/plain": text,
        "text/html": f'<pre class="infini-status-line" style="{STATUS_STYLE}">'
        f"{html.escape(text)}</pre>",
    }


class Printer(Protocol):
    """Where a cell's labeled output goes. A printer may also have ``live(text)``: lines
    shown in place of the previous call's (progress lines, see ``Cell._show_live``), and
    ``can_replay()``/``replay(items)``: everything it showed for the cell, replaced."""

    def out(self, text: str) -> None: ...
    def err(self, text: str) -> None: ...
    def display(self, label: str, output: dict) -> None: ...
    def status(self, text: str, handle=None): ...  # optional: a line updated in place


def show_items(printer: Printer, items: list[Item]) -> None:
    """Write ``items`` (see core/transcript.py), a stream's consecutive lines at once."""
    kind, batch = None, []

    def flush() -> None:
        if batch:
            (printer.out if kind == "stdout" else printer.err)("".join(batch))
            batch.clear()

    for item in items:
        if item.kind in TEXT_KINDS:
            if item.kind != kind:
                flush()
                kind = item.kind
            batch.append(f"{rank_label(item.ranks)} {item.payload}\n")
            continue
        flush()
        if item.kind == "note":
            printer.err(item.payload)
        elif item.kind == "figures":
            printer.display("", figure_grid(item.payload))
        else:
            printer.display(rank_label(item.ranks), item.payload)
    flush()


def figure_grid(figures: list[tuple[int, dict]]) -> dict:
    """One display of several ranks' figures side by side, each under its rank's label,
    wrapping to the notebook's width."""
    cells = []
    for rank, output in figures:
        data = output.get("data") or {}
        if "image/png" in data:
            png = data["image/png"].strip()
            img = f'<img src="data:image/png;base64,{png}" style="max-width:100%">'
        else:
            img = data["image/svg+xml"]
        cells.append(
            f'<figure style="margin:0"><figcaption style="font-family:monospace">'
            f"{html.escape(rank_label([rank]))}</figcaption>{img}</figure>"
        )
    grid = "display:grid;grid-template-columns:repeat(auto-fill,minmax(320px,1fr));gap:8px"
    plain = f"<figures of {rank_label(sorted({r for r, _ in figures}))[1:-1]}>"
    return {"data": {"text/html": f'<div style="{grid}">{"".join(cells)}</div>',
                     "text/plain": plain}, "metadata": {}}  # fmt: skip


class TextPrinter:
    """The running cell's streams and IPython's display publisher. ``owns_cell``: the
    whole cell is this printer's (``%%dist``), so at the cell's end it may clear the
    cell's output and show it again in rank order; ``session.run`` in a cell of the
    user's may share it with other output, and only adds to it."""

    def __init__(self, echo: bool, owns_cell: bool = False, preamble: str = ""):
        self.echo, self.owns_cell = echo, owns_cell
        self.preamble = preamble  # printed before the cell ran (auto mode's marker): kept
        self._live = None  # the display of this cell's progress lines, once there are some
        self._status = None  # (its display, its text): the line status() keeps in place

    def can_replay(self) -> bool:
        if not (self.echo and self.owns_cell):
            return False
        from IPython import get_ipython

        return getattr(get_ipython(), "kernel", None) is not None

    def replay(self, items: list[Item]) -> None:
        """The cell's output replaced by ``items``: cleared when the first of them comes
        (``wait``: no blank moment in between), which also ends the live display."""
        from IPython.display import clear_output

        clear_output(wait=True)
        self._live = None
        self.out(self.preamble)
        if self._status is not None:  # the clear took the status line too: shown again,
            from IPython.display import display  # under its id, so that updates reach it

            handle, text = self._status
            display(status_bundle(text), raw=True, display_id=handle.display_id)
        show_items(self, items)

    def out(self, text: str) -> None:
        if self.echo and text:
            sys.stdout.write(text)
            sys.stdout.flush()

    def err(self, text: str) -> None:
        if self.echo and text:
            sys.stderr.write(text)
            sys.stderr.flush()

    def status(self, text: str, handle=None):
        """A line updated in place (a display with an id); a terminal gets its first text."""
        if not self.echo:
            return handle
        from IPython import get_ipython

        ip = get_ipython()
        if ip is None or getattr(ip, "kernel", None) is None:
            if handle is None:
                self.err(f"{text}\n")
            return True
        from IPython.display import display

        if handle is None:
            handle = display(status_bundle(text), raw=True, display_id=True)
        else:
            handle.update(status_bundle(text), raw=True)
        self._status = (handle, text)
        return handle

    def live(self, text: str) -> None:
        """Show ``text`` in place of what the last call showed (a notebook display with an
        id, updated; outside a kernel nothing: the final lines still come on the stream)."""
        if not self.echo:
            return
        bundle = {"text/plain": text}
        if self._live is not None:
            self._live.update(bundle, raw=True)
            return
        from IPython import get_ipython
        from IPython.display import display

        if text and getattr(get_ipython(), "kernel", None) is not None:
            self._live = display(bundle, raw=True, display_id=True)

    def display(self, label: str, output: dict) -> None:
        if not self.echo:
            return
        from IPython import get_ipython

        ip = get_ipython()
        data = output.get("data", {})
        if ip is None or getattr(ip, "display_pub", None) is None or set(data) == {"text/plain"}:
            self.out(prefix_lines(label, data.get("text/plain", "")))  # plain values inline
            return
        self.out(display_heading(label, output))
        ip.display_pub.publish(data=data, metadata=output.get("metadata") or {})
