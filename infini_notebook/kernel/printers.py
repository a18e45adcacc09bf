"""Where a cell's labeled output goes: the Printer protocol, and TextPrinter, the running
cell's streams and IPython's display publisher (a line or a display updated in place)."""

from __future__ import annotations

import sys
from typing import Protocol

from ..core.output import prefix_lines


class Printer(Protocol):
    """Where a cell's labeled output goes. A printer may also have ``live(text)``: lines
    shown in place of the previous call's (progress lines, see ``Cell._show_live``)."""

    def out(self, text: str) -> None: ...
    def err(self, text: str) -> None: ...
    def display(self, label: str, output: dict) -> None: ...
    def status(self, text: str, handle=None): ...  # optional: a line updated in place


class TextPrinter:
    """The running cell's streams and IPython's display publisher."""

    def __init__(self, echo: bool):
        self.echo = echo
        self._live = None  # the display of this cell's progress lines, once there are some

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
            return display({"text/plain": text}, raw=True, display_id=True)
        handle.update({"text/plain": text}, raw=True)
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
        self.out(f"{label}\n")
        ip.display_pub.publish(data=data, metadata=output.get("metadata") or {})
