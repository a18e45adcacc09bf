"""Benchmark figures (matplotlib, imported when drawn): bandwidth curves per group kind, the
p2p sender x receiver heatmap, a figure as a display that follows the notebook's theme, and
``BenchView``, the widget that switches collective, group and metric.

Figures follow the theme: they are drawn on a transparent background with stand-in colors for
text, axes and the legend's box, and shown as inline SVG in which those stand-ins become the
theme's CSS variables (``render.FG``/``BG``): dark text on a light notebook, light on a dark
one. A PNG on a white card goes beside it for viewers that show no HTML.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

from .render import BG, FG, size_label

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

FIGURE_DPI = 100
# Stand-ins, swapped in the SVG for the theme's text and background colors; off the palette
# and the colormaps so nothing else is drawn in them.
FG_MARK, BG_MARK = "#010203", "#fefdfc"
_TEXT_AND_LINES = (
    "text.color", "axes.labelcolor", "axes.edgecolor", "xtick.color", "ytick.color",
    "grid.color", "legend.edgecolor",
)  # fmt: skip
THEMED_RC = dict.fromkeys(_TEXT_AND_LINES, FG_MARK) | {
    "legend.facecolor": BG_MARK,
    "figure.facecolor": "none",
    "axes.facecolor": "none",
}
SVG_RC = {"svg.fonttype": "none", "svg.hashsalt": "infini"}  # text as text; stable ids
METRICS = {"busbw_gbps": "busbw (GB/s)", "algbw_gbps": "algbw (GB/s)"}
PANEL_SIZE = (7.5, 4.6)  # inches, one collective; several: two panels a row, a bit smaller
MAX_SIZE_TICKS = 9  # message sizes labeled on the x axis (powers of 2, thinned to fit)


def bench_curves(
    df: pd.DataFrame, collective: str, metric: str = "busbw_gbps", group: str | None = None
) -> dict[str, pd.DataFrame]:
    """Per group: size_bytes with mean/min/max of ``metric`` over that kind's group instances."""
    rows = df[df["collective"] == collective]
    if group not in (None, "all"):
        rows = rows[rows["group"] == group]
    curves = {}
    for name, part in rows.groupby("group", sort=False):
        agg = part.groupby("size_bytes")[metric].agg(["mean", "min", "max"]).reset_index()
        curves[str(name)] = agg.sort_values("size_bytes")
    return curves


def plot_busbw(
    df: pd.DataFrame,
    collective: str | None = None,
    metric: str = "busbw_gbps",
    group: str | None = None,
) -> Figure:
    """Bandwidth against message size, one panel per collective (or just ``collective``),
    one line per group kind; shading spans the groups of a kind when they differ."""
    from matplotlib import rc_context
    from matplotlib.figure import Figure

    collectives = [collective] if collective else list(dict.fromkeys(df["collective"]))
    ncols = min(2, max(1, len(collectives)))
    nrows = math.ceil(len(collectives) / ncols) if collectives else 1
    width, height = PANEL_SIZE if ncols == 1 else (5.8, 4.0)
    with rc_context(THEMED_RC):  # artists take their colors when made
        fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
        axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
        for ax, name in zip(axes, collectives):
            _plot_curves(ax, bench_curves(df, name, metric, group), metric)
            ax.set_title(name)
        for ax in axes[len(collectives) :]:
            ax.set_visible(False)
        if not collectives:
            axes[0].text(0.5, 0.5, "no benchmark rows", ha="center", va="center")
        if df.attrs.get("caveat"):  # ranks share a GPU: not the hardware's figures
            fig.suptitle(df.attrs["caveat"], fontsize=9)
    return settled_layout(fig)


def _plot_curves(ax, curves: dict[str, pd.DataFrame], metric: str) -> None:
    for i, (name, c) in enumerate(curves.items()):
        color = f"C{i}"
        ax.plot(c["size_bytes"], c["mean"], marker="o", ms=3, label=name, color=color)
        if (c["max"] > c["min"]).any():
            ax.fill_between(c["size_bytes"], c["min"], c["max"], alpha=0.2, color=color)
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(LogLocator(base=2, numticks=MAX_SIZE_TICKS))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: size_label(x)))
    if all((c["min"] > 0).all() for c in curves.values()) and curves:
        ax.set_yscale("log")  # small messages are orders of magnitude slower
        low = min(c["min"].min() for c in curves.values())
        high = max(c["max"].max() for c in curves.values())
        subs = (1.0,) if high / low >= 100 else (1.0, 2.0, 5.0)  # a few labels in any range
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _pos: f"{y:g}"))
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_minor_locator(NullLocator())  # one gridline per labeled tick, no more
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel(METRICS.get(metric, metric))
    ax.grid(True, which="major", alpha=0.15)
    if curves:
        ax.legend(title="group", fontsize=9, title_fontsize=9)


def p2p_heatmap(
    matrix: Any, title: str | None = None, hosts: Sequence[str] | None = None
) -> Figure:
    """Sender x receiver bandwidth (``bench.run_p2p``'s src x dst DataFrame, or any square
    array; NaN diagonal left blank): a slow link is a dark cell, a slow rank a dark row and
    column. Values are printed in the cells up to 16 ranks. ``hosts`` (one per rank): lines
    in the background's color fence each host's block, so intra-node pairs sit on the
    diagonal blocks."""
    from matplotlib import rc_context

    with rc_context(THEMED_RC):
        return settled_layout(_heatmap(matrix, title, hosts))


def settled_layout(fig: Figure) -> Figure:
    """Constrained layout moves the axes a little on every draw: lay out once and keep it,
    so a figure's PNG and SVG agree and a re-run notebook diffs clean."""
    fig.draw_without_rendering()
    fig.set_layout_engine("none")
    return fig


def _heatmap(matrix: Any, title: str | None, hosts: Sequence[str] | None) -> Figure:
    import numpy as np
    from matplotlib.figure import Figure

    values = np.asarray(getattr(matrix, "values", matrix), dtype=float)
    n = values.shape[0]
    index, columns = getattr(matrix, "index", None), getattr(matrix, "columns", None)
    side = min(max(n, 4), 20)
    fig = Figure(figsize=(1.6 + 0.5 * side, 1.0 + 0.45 * side), layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(np.ma.masked_invalid(values), cmap="viridis")
    fig.colorbar(image, ax=ax, shrink=0.85, label="GB/s")
    ax.set_xticks(range(n), labels=[str(c) for c in (columns if columns is not None else range(n))])
    ax.set_yticks(range(n), labels=[str(i) for i in (index if index is not None else range(n))])
    ax.set_xlabel(f"{getattr(columns, 'name', None) or 'receiver'} rank")
    ax.set_ylabel(f"{getattr(index, 'name', None) or 'sender'} rank")
    size = getattr(matrix, "attrs", {}).get("size_bytes")
    ax.set_title(title or "send/recv bandwidth" + (f", {size_label(size)}B" if size else ""))
    if getattr(matrix, "attrs", {}).get("caveat"):  # ranks share a GPU
        fig.suptitle(matrix.attrs["caveat"], fontsize=9)
    if hosts is not None and len(set(hosts)) > 1:
        for i in range(n - 1):
            if hosts[i] != hosts[i + 1]:
                ax.axhline(i + 0.5, color=BG_MARK, linewidth=2)  # a gap in any theme
                ax.axvline(i + 0.5, color=BG_MARK, linewidth=2)
    if n <= 16 and np.isfinite(values).any():
        top = np.nanmax(values)
        for (i, j), v in np.ndenumerate(values):
            if np.isfinite(v):
                color = "black" if v > 0.6 * top else "white"
                ax.text(j, i, f"{v:.2g}", ha="center", va="center", fontsize=7, color=color)
    return fig


def figure_png(fig: Figure, dpi: int = FIGURE_DPI) -> bytes:
    """The figure on a white card (the stand-in colors read as black and white)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, facecolor="white")
    return buf.getvalue()


def figure_svg(fig: Figure) -> str:
    """The figure as an ``<svg>`` element to put in HTML, its text and axes in the theme's
    colors (matplotlib writes colors as CSS in ``style`` attributes, where ``var()`` works)."""
    from matplotlib import rc_context

    buf = io.StringIO()
    with rc_context(SVG_RC):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    svg = buf.getvalue()
    svg = svg[svg.index("<svg") :]  # no XML prolog inside HTML
    svg = svg.replace(FG_MARK, FG).replace(BG_MARK, BG)
    return svg.replace("<svg ", '<svg style="max-width:100%;height:auto" ', 1)


def figure_html(fig: Figure) -> str:
    return f'<div class="infini-figure">{figure_svg(fig)}</div>'


def figure_bundle(fig: Figure) -> dict:
    """A display of the figure (``display(bundle, raw=True)``): the theme-following SVG for
    notebooks, the PNG for viewers without HTML."""
    return {
        "text/html": figure_html(fig),
        "image/png": base64.b64encode(figure_png(fig)).decode(),
        "text/plain": f"<Figure size {fig.get_figwidth():g}x{fig.get_figheight():g} in>",
    }


def bench_summary(df: pd.DataFrame, metric: str = "busbw_gbps") -> pd.DataFrame:
    """Peak ``metric`` per collective and group, with the size it was reached at."""
    best = df.loc[df.groupby(["collective", "group"], sort=False)[metric].idxmax()]
    out = best[["collective", "group", "group_size", "size_bytes", metric]].copy()
    out["size"] = out["size_bytes"].map(size_label)
    return out.drop(columns="size_bytes").reset_index(drop=True)


class BenchView(widgets.VBox):
    """Benchmark rows as a widget: pick the collective and group kind, busbw or algbw; the
    figure (inline SVG in the theme's colors) redraws on each change. ``p2p``: optional
    sender x receiver matrix shown as a heatmap below."""

    def __init__(self, df: pd.DataFrame, p2p: Any = None):
        self.df = df
        self.p2p = p2p
        collectives = list(dict.fromkeys(df["collective"]))
        self.collective = widgets.Dropdown(options=collectives, description="collective")
        groups = ["all", *dict.fromkeys(df["group"])]
        self.group = widgets.Dropdown(options=groups, value="all", description="group")
        self.metric = widgets.ToggleButtons(
            options=[("busbw", "busbw_gbps"), ("algbw", "algbw_gbps")], value="busbw_gbps"
        )
        self.image = widgets.HTML()
        self.figure: Figure | None = None
        children = [widgets.HBox([self.collective, self.group, self.metric]), self.image]
        if p2p is not None:
            children.append(widgets.HTML(figure_html(p2p_heatmap(p2p))))
        super().__init__(children)
        self.add_class("infini-bench")
        for control in (self.collective, self.group, self.metric):
            control.observe(lambda _: self.redraw(), names="value")
        self.redraw()

    def redraw(self) -> None:
        self.figure = plot_busbw(
            self.df, self.collective.value, self.metric.value, self.group.value
        )
        self.image.value = figure_html(self.figure)

    def _repr_mimebundle_(self, **kwargs) -> dict:
        bundle = super()._repr_mimebundle_(**kwargs) or {}
        metric = self.metric.value
        parts = [figure_html(plot_busbw(self.df, metric=metric))]
        if self.p2p is not None:
            parts.append(figure_html(p2p_heatmap(self.p2p)))
        summary = bench_summary(self.df, metric)
        parts.append(summary.to_html(index=False))
        bundle["text/html"] = "".join(parts)
        bundle["text/plain"] = f"peak {METRICS[metric]} per collective and group\n" + (
            summary.to_string(index=False)
        )
        return bundle


def bench_view(df: pd.DataFrame, p2p: Any = None) -> BenchView:
    return BenchView(df, p2p)
