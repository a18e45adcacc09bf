"""``StatusWidget``: live tiles, one per rank, refreshed by a background thread from a status
source (the session, duck-typed: viz never imports the cluster), and the registry that keeps
one live widget per session: the latest shown (``%dist_status`` or the session's own
display). An earlier one is frozen as a newer one appears, and the live one as the session
stops or the kernel shuts down, each keeping what it showed then, so scrolling back reads
the past as it was.

``%dist_status`` shows plain HTML and text in a display updated in place, not a widget: a
widget's output needs its kernel, and once that is gone (a restart, a notebook opened
later) JupyterLab showed "Error displaying widget: model not found" for it, or a fallback
written when it was first shown ("session ready"). JupyterLab drops what a kernel sends
once a restart begins, so no last message can fix it up: the display holds the last state
all along."""

from __future__ import annotations

import threading
import time
import weakref
from typing import TYPE_CHECKING, Protocol

import ipywidgets as widgets

from .progress import in_kernel
from .render import CSS, esc, grid_shape
from .status_render import (
    status_html,
    status_summary,
    status_text,
    status_tile_html,
    tiles_grid,
)

if TYPE_CHECKING:
    from ..core.layout import ParallelLayout
    from ..core.state import RankState


class StatusSource(Protocol):
    """What the status views read (``cluster.Session`` is one): plain snapshots, no engines."""

    world_size: int
    running: bool

    @property
    def layout(self) -> ParallelLayout: ...  # may raise: a plan without layout sizes

    def status(self) -> list[RankState]: ...

    def template_rss(self) -> int | None: ...  # optional: the warm template's memory

    def spare_engines(self) -> int: ...  # optional: engines kept for the next hard restart

    # optional: who drives a kept session this kernel no longer drives (or that it was
    # stopped or detached), else None
    def gone_line(self) -> str | None: ...


class _Shown:
    """What one part of the status shows (a tile, the line), with or without a widget."""

    def __init__(self) -> None:
        self.value = ""
        self.widget: widgets.HTML | None = None  # its view where the status is a widget

    def set(self, html: str) -> None:
        self.value = html
        if self.widget is not None:
            self.widget.value = html  # only a changed value goes to the browser


class StatusWidget:
    """Live rank tiles for a session: a daemon thread polls ``session.status()`` every
    ``interval`` seconds (the kernel stays free) and stops when the session stops or on
    ``close()``. ``refresh()`` does one poll by hand.

    Shown two ways. ``show()`` (``%dist_status``): a display updated in place, plain HTML
    and text, so that a notebook saved at any time, or whose kernel is gone, shows the last
    state (a widget's output then read "Error displaying widget: model not found").
    ``_repr_mimebundle_`` (a session as a cell's value): an ipywidget, HTML and text
    fallbacks as of that moment."""

    def __init__(self, session: StatusSource, interval: float = 0.5, live: bool = True):
        self.session = session
        self.interval = interval
        self.layout_ = _session_layout(session)
        self.states: list[str] = []
        self.title = ""  # the summary line it shows
        self.as_of = ""  # when the tiles were last brought up to date
        self._busy_since: dict[int, float] = {}  # rank -> when this widget first saw it busy
        self.summary = _Shown()
        self.tiles = [_Shown() for _ in range(session.world_size)]
        self._cols = grid_shape(self.layout_).ncols if self.layout_ is not None else 4
        self._rows: list[RankState] = []  # the last poll's rows, for the text render
        self._display = None  # the display ``show`` made (updated in place)
        self._publisher = self._parent = None  # IPython's display publisher, the cell's header
        self._shown: dict | None = None  # what that display shows now
        self._view: widgets.VBox | None = None  # the widget, made when shown as one
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.refresh()
        if live:
            self.start()

    def refresh(self) -> list[RankState]:
        """Poll once and update the tiles (only changed ones send anything to the browser)."""
        states = self.session.status()
        now = time.monotonic()
        for tile, rs in zip(self.tiles, states):
            if rs.state != "busy":
                self._busy_since.pop(rs.rank, None)
            since = self._busy_since.setdefault(rs.rank, now) if rs.state == "busy" else None
            tile.set(status_tile_html(rs, self.layout_, None if since is None else now - since))
        self._rows = states
        self._show_title(status_summary(states, *_helpers(self.session, states)))
        self.as_of = time.strftime("%H:%M:%S")
        # Last: whoever waits on ``states`` then finds the tiles and summary of this poll
        # (set first, they once showed a poll behind the states).
        self.states = [rs.state for rs in states]
        return states

    def _show_title(self, title: str) -> None:
        self.title = title
        self.summary.set(f'<div class="infini-title">{esc(title)}</div>')
        self._update_display()

    def bundle(self) -> dict:
        """What it shows now, as HTML and text: the line, then the tiles."""
        grid = ";".join(f"{k}:{v}" for k, v in tiles_grid(self._cols).items())
        tiles = "".join(tile.value for tile in self.tiles)
        html = (
            f'{CSS}<div class="infini-status">{self.summary.value}'
            f'<div style="{grid}">{tiles}</div></div>'
        )
        table = status_text(self._rows, self.layout_).split("\n")[1:]  # under our own line
        return {"text/html": html, "text/plain": "\n".join([self.title] + table)}

    def show(self) -> None:
        """Display it as a display of its own, updated in place while it is live."""
        from IPython import get_ipython
        from IPython.display import display

        self._shown = self.bundle()
        self._display = display(self._shown, raw=True, display_id=True)
        self._publisher = getattr(get_ipython(), "display_pub", None)
        self._parent = getattr(self._publisher, "parent_header", None)

    def _update_display(self) -> None:
        if self._display is None:
            return
        bundle = self.bundle()
        if bundle == self._shown:
            return
        self._shown = bundle
        # As a message of the %dist_status cell, whatever cell runs now: JupyterLab finds
        # the display by its id; a runner (nbclient) reads only the running cell's messages,
        # so the notebook it writes keeps what the cell showed, not a later moment's state.
        pub = self._publisher
        token = pub.set_thread_parent(self._parent) if hasattr(pub, "set_thread_parent") else None
        try:
            self._display.update(bundle, raw=True)
        except Exception:  # a kernel closing its channels: nothing more to tell
            pass
        finally:
            if token is not None:
                pub.reset_thread_parent(token)

    def freeze(self) -> None:
        """Stop updating: the tiles keep what they show, the line says since when."""
        self.stop()
        self._freeze_title()

    def _freeze_title(self) -> None:
        if " · as of " not in self.title:
            self._show_title(f"{self.title} · as of {time.strftime('%H:%M:%S')}")

    @property
    def live(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.live:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._poll, name="infini-status", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(self.interval):
            # First, and asking nothing of the ranks or the store: a kept session another
            # kernel drives now (or stopped) freezes with one line, told once.
            gone = _gone(self.session)
            if gone is not None:
                self._show_title(f"session {gone} · tiles as of {self.as_of}")
                return
            running = self.session.running  # before the poll: a stop during it is seen next
            try:
                self.refresh()
            except Exception:  # a poll must never kill the kernel's display; try again
                continue
            if not running:  # this poll began after the stop: it shows "stopped"
                self._freeze_title()
                return

    def stop(self, timeout: float = 5.0) -> None:
        """Stop polling and wait for the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def close(self) -> None:
        self.stop()
        if self._view is not None:
            self._view.close_all()
            self._view = None

    def widget(self) -> widgets.VBox:
        """The tiles as an ipywidget (made once), updated as the status is."""
        if self._view is None:
            for part in [self.summary, *self.tiles]:
                part.widget = widgets.HTML(part.value)
            for tile in self.tiles:
                tile.widget.add_class("infini-rank-tile-box")
            css = tiles_grid(self._cols)  # reflows to the output's width (status_render)
            grid = widgets.GridBox(
                [tile.widget for tile in self.tiles],
                layout=widgets.Layout(
                    grid_template_columns=css["grid-template-columns"],
                    grid_gap=css["gap"],
                    max_width=css["max-width"],
                    width="100%",
                ),
            )
            self._view = widgets.VBox([widgets.HTML(CSS), self.summary.widget, grid])
            self._view.add_class("infini-status")
        return self._view

    def _repr_mimebundle_(self, **kwargs) -> dict:
        states = self.session.status()
        bundle = self.widget()._repr_mimebundle_(**kwargs) or {}
        helpers = _helpers(self.session, states)
        bundle["text/html"] = status_html(states, self.layout_, *helpers)
        bundle["text/plain"] = status_text(states, self.layout_, *helpers)
        return bundle


def _helpers(session: StatusSource, states: list[RankState]) -> tuple[int | None, int, str]:
    """The warm template's memory, the number of spare engines and the session's line
    ('ready', 'needs %dist_restart --hard: ...'), where the session tells them."""
    rss = getattr(session, "template_rss", None)
    spares = getattr(session, "spare_engines", None)
    line = getattr(session, "session_line", None)
    return (
        rss() if rss is not None else None,
        spares() if spares is not None else 0,
        line(states) if line is not None else "",
    )


def _gone(session: StatusSource) -> str | None:
    """Where the session tells it: the line of a kept session this kernel no longer drives."""
    line = getattr(session, "gone_line", None)
    try:
        return line() if line is not None else None
    except Exception:  # a poll must never kill the kernel's display; asked again next poll
        return None


def _session_layout(session: StatusSource) -> ParallelLayout | None:
    try:
        return session.layout
    except Exception:  # a plan without layout sizes: tiles still work, coords stay raw
        return None


_status_widgets: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def status_widget(session: StatusSource, interval: float = 0.5) -> StatusWidget:
    """A new live status widget for the session (``%dist_status``, the session's own
    display); the one shown before it is frozen, keeping what it shows now."""
    earlier = _status_widgets.get(session)
    if earlier is not None:
        earlier.freeze()
    widget = StatusWidget(session, interval=interval)
    _status_widgets[session] = widget
    return widget


def close_status_widgets() -> None:
    """Stop every status widget's thread (tests, kernel shutdown)."""
    for widget in list(_status_widgets.values()):
        widget.close()
    _status_widgets.clear()


def session_mimebundle(session: StatusSource) -> dict:
    """What a session shows as a cell's value: the live widget in a kernel, else HTML/text."""
    header = repr(session)
    if in_kernel() and session.running:
        bundle = status_widget(session)._repr_mimebundle_()
    else:
        states = session.status()
        helpers = _helpers(session, states)
        layout = _session_layout(session)
        bundle = {
            "text/html": status_html(states, layout, *helpers),
            "text/plain": status_text(states, layout, *helpers),
        }
    bundle["text/plain"] = f"{header}\n{bundle['text/plain']}"
    return bundle
