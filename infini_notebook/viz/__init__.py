"""Widgets, HTML and text fallbacks, and figures; fed plain data, never talking to engines.

Three views, each a live ipywidget in JupyterLab plus a static HTML render (nbconvert, GitHub)
and a plain-text render (terminals) that both name every rank with its coordinates:

- ``StatusWidget`` (``status``): one tile per rank (coords, host, device, pid, state),
  refreshed by a background thread from ``session.status()`` so it moves while cells run:
  for ``%dist_status`` a display updated in place (a saved notebook keeps its last state),
  for a session shown as a cell's value an ipywidget.
- ``GroupGrid`` (``grid``): the rank grid of a ``ParallelLayout`` colored by one kind's groups;
  clicking a rank outlines every group it belongs to. Works without a session, for planning.
- ``BenchView`` / ``plot_busbw`` / ``p2p_heatmap`` (``bench_plots``): benchmark curves and the
  p2p matrix.

Plus two sinks the kernel side feeds through callbacks (``progress``): ``Progress`` and
``OutputPrinter``. The looks are pure functions in ``render`` and ``status_render`` (no
ipywidgets), so tests check them without a browser and a layout renders without widgets.

Every name stays reachable as ``viz.X``, imported on first use: ``viz.layout_html`` loads only
the pure renderer, ``viz.StatusWidget`` loads ipywidgets.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "render": (
        "CSS", "GridShape", "GroupTile", "MAX_GRID_COLS", "PALETTE", "SPANS_HOSTS",
        "WIDGET_MIME", "col_label", "color_kinds", "coords_label", "default_color_kind", "esc",
        "focus_kinds", "format_bytes", "grid_shape", "group_index", "group_tiles",
        "groups_legend", "hosts_by_block", "layout_html", "layout_mimebundle", "layout_text",
        "positions",
        "row_label", "selection_text", "size_label", "spanning_groups", "table_bundle",
        "text_table",
    ),
    "status_render": (
        "BUSY_SHOWN_AFTER_S", "STATE_COLORS", "device_label", "device_text", "state_text",
        "status_html", "status_summary", "status_text", "status_tile_html", "usage_text",
    ),
    "grid": ("GroupGrid",),
    "status": (
        "StatusSource", "StatusWidget", "close_status_widgets", "session_mimebundle",
        "status_widget",
    ),
    "progress": ("OutputPrinter", "Progress", "in_kernel"),
    "profile_plots": ("plot_breakdown",),
    "profile_render": ("profile_html", "profile_text"),
    "bench_plots": (
        "BenchView", "FIGURE_DPI", "METRICS", "bench_curves", "bench_summary", "bench_view",
        "figure_bundle", "figure_html", "figure_png", "figure_svg", "p2p_heatmap", "plot_busbw",
    ),
}  # fmt: skip
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
_RENAMED = {"_bytes": ("render", "format_bytes")}  # old names callers still use

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name == "widgets":  # ``viz.widgets`` was ipywidgets itself
        return importlib.import_module("ipywidgets")
    module, attr = _RENAMED.get(name) or (_WHERE.get(name), name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    globals()[name] = value  # next lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE, *_RENAMED})
