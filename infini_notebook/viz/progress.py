"""Sinks the kernel side feeds through callbacks, so it never renders itself: ``Progress``
(start-up, sweeps) and ``OutputPrinter`` (a ``%%dist --background`` cell)."""

from __future__ import annotations

import time

import ipywidgets as widgets

from ..core.output import prefix_lines
from ..core.transcript import display_heading
from .render import esc


def in_kernel() -> bool:
    """Widgets need a kernel with comms; a terminal IPython gets text only."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


class OutputPrinter:
    """Where a background ``%%dist`` cell writes: an Output widget shown in its cell, filled
    from the session's thread while the notebook runs other cells."""

    def __init__(self) -> None:
        self.widget = widgets.Output()
        self.widget.add_class("infini-background")

    def out(self, text: str) -> None:
        if text:
            self.widget.append_stdout(text)

    def err(self, text: str) -> None:
        if text:
            self.widget.append_stderr(text)

    def status(self, text: str, handle=None):
        """Its first text only: an Output widget cannot update a line in place, and a
        nested widget would save as 'Label(...)' in the notebook."""
        if handle is None:
            self.err(f"{text}\n")
        return True

    def can_replay(self) -> bool:
        """No: an Output widget emptied and refilled from a background thread is mirrored
        by JupyterLab, but a notebook executed by nbclient (papermill, CI, our tutorials)
        keeps both copies. A background cell's output stays in arrival order."""
        return False

    def display(self, label: str, output: dict) -> None:
        data = output.get("data", {})
        if set(data) == {"text/plain"}:
            self.out(prefix_lines(label, data["text/plain"]))
            return
        self.out(display_heading(label, output))
        self.widget.append_display_data({"data": data, "metadata": output.get("metadata", {})})


class Progress:
    """A progress bar drawn as a display updated in place (display_id): live while work
    runs, and a saved notebook keeps its last state (a saved widget reads '0%').
    Call it as ``progress(done, total, what)``; outside a kernel it stays silent. Nothing
    is drawn before the first call, so work refused up front (bad flags) draws no bar."""

    WIDTH = 30

    def __init__(self, desc: str):
        self.desc = desc
        self._t0 = time.monotonic()
        self._shown_at = 0.0
        self._handle = None
        self._state = (0, 0, "")
        self._drawn = not in_kernel()  # outside a kernel: never drawn

    def __call__(self, done: int, total: int, what: str = "") -> None:
        self._state = (done, total, what)
        now = time.monotonic()
        if not self._drawn:
            from IPython.display import display

            self._drawn, self._shown_at = True, now
            self._handle = display(self._bundle(), raw=True, display_id=True)
            return
        if self._handle is None or (now - self._shown_at < 0.1 and done < total):
            return
        self._shown_at = now
        self._handle.update(self._bundle(), raw=True)

    def _bundle(self) -> dict:
        done, total, what = self._state
        frac = done / total if total else 0.0
        filled = int(round(frac * self.WIDTH))
        elapsed = time.monotonic() - self._t0
        tail = f"{done}/{total} {what} ({elapsed:.1f} s)" if total else "starting..."
        text = f"{self.desc}: [{'#' * filled}{'.' * (self.WIDTH - filled)}] {tail}"
        html = (
            f'<div class="infini-progress">{esc(self.desc)}: '
            f'<progress value="{done}" max="{max(total, 1)}" style="width:14em"></progress> '
            f"{esc(tail)}</div>"
        )
        return {"text/plain": text, "text/html": html}
