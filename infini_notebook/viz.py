"""Widgets, HTML and text fallbacks, and figures; fed plain data, never talking to engines.

Three views, each a live ipywidget in JupyterLab plus a static HTML render (nbconvert, GitHub)
and a plain-text render (terminals) that both name every rank with its coordinates:

- ``StatusWidget``: one tile per rank (coords, host, device, pid, state), refreshed by a
  background thread from ``session.status()`` so it moves while cells run.
- ``GroupGrid``: the rank grid of a ``ParallelLayout`` colored by one kind's groups; clicking
  a rank outlines every group it belongs to. Works without a session, for planning.
- ``BenchView`` / ``plot_busbw`` / ``p2p_heatmap``: benchmark curves and the p2p matrix.

Plus two sinks the kernel side feeds through callbacks, so it never renders itself:
``Progress`` (start-up and sweeps) and ``OutputPrinter`` (a ``%%dist --background`` cell).

The tile and grid logic (``grid_shape``, ``group_tile``, ``status_tile_html`` ...) is pure
so tests check it without a browser; the widget classes only map it onto ipywidgets.
"""

from __future__ import annotations

import base64
import html
import io
import math
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

from .output import prefix_lines

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

    from .cluster import RankState, Session
    from .groups import ParallelLayout

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
# Soft colors so black text stays readable; neighbouring groups get clearly different hues.
PALETTE = (
    "#8dd3c7", "#fdb462", "#bebada", "#fb8072", "#80b1d3", "#b3de69", "#fccde5", "#ffed6f",
    "#bc80bd", "#ccebc5", "#a6cee3", "#fdbf6f", "#cab2d6", "#b2df8a", "#fb9a99", "#e5d8bd",
)  # fmt: skip
STATE_COLORS = {
    "idle": "#2e9d4f",
    "busy": "#e0a100",
    "error": "#d33c3c",
    "stuck": "#8e44ad",  # ignored an interrupt; busy until the collective timeout
    "dead": "#444444",
    "stopped": "#9e9e9e",
}
BUSY_SHOWN_AFTER_S = 3  # from then on a busy tile shows for how long
MAX_GRID_COLS = 16  # a single wide dim wraps into rows of at most this many ranks
SPANS_HOSTS = "⇄"  # marks tiles whose group crosses a host boundary

CSS = """
<style>
.infini-rank-tile { font-family: var(--jp-ui-font-family, sans-serif); font-size: 12px;
  line-height: 1.35; padding: 5px 8px; border-radius: 6px; border: 1px solid #ccc;
  border-left-width: 7px; background: #fff; color: #222; min-width: 200px; }
.infini-rank-tile .infini-state { float: right; margin-left: 8px; font-weight: 600; color: #fff;
  padding: 0 6px; border-radius: 8px; font-size: 11px; }
.infini-rank-tile .infini-muted { color: #666; }
.infini-rank-tile .infini-usage { font-variant-numeric: tabular-nums; }
.infini-group-tile.jupyter-button { white-space: pre; height: auto; line-height: 1.35;
  padding: 6px 4px; font-size: 12px; border-radius: 6px; }
.infini-group-tile.infini-dim { opacity: 0.35; }
.infini-grid-head { font-size: 12px; color: #444; font-weight: 600; text-align: center;
  align-self: center; }
.infini-title { font-size: 13px; font-weight: 600; margin: 2px 0 4px 0; }
.infini-static-grid td { padding: 2px; text-align: center; }
.infini-static-grid .infini-group-tile { white-space: pre; padding: 6px 10px;
  border-radius: 6px; font-size: 12px; line-height: 1.35; border: 1px solid #bbb; }
</style>
"""


def _esc(value: Any) -> str:
    return html.escape(str(value))


# --------------------------------------------------------------------------- grid (pure)


@dataclass(frozen=True)
class GridShape:
    """Ranks in reading order: ``divmod(rank, ncols)`` is (row, col). Columns are the fastest
    dims (size > 1) of the order, rows the slowest; both list dims fastest first."""

    col_dims: tuple[str, ...]
    row_dims: tuple[str, ...]
    nrows: int
    ncols: int

    def cell(self, rank: int) -> tuple[int, int]:
        return divmod(rank, self.ncols)


def grid_shape(layout: ParallelLayout) -> GridShape:
    """Split the non-trivial dims (fastest first) where the grid is closest to square,
    preferring wide; a prefix split keeps ranks in reading order (rank = row*ncols + col)."""
    dims = [d for d in layout.dims if getattr(layout, d) > 1]
    if len(dims) <= 1:  # one dim: a single row, wrapped if very wide
        ncols = _wrap_width(layout.world_size)
        return GridShape(tuple(dims), (), layout.world_size // ncols, ncols)
    best = None
    for k in range(1, len(dims)):
        ncols = math.prod(getattr(layout, d) for d in dims[:k])
        nrows = layout.world_size // ncols
        score = (abs(math.log(ncols / nrows)), nrows > ncols, ncols > MAX_GRID_COLS)
        if best is None or score < best[0]:
            best = (score, k, nrows, ncols)
    _, k, nrows, ncols = best
    return GridShape(tuple(dims[:k]), tuple(dims[k:]), nrows, ncols)


def _wrap_width(n: int) -> int:
    """Largest divisor of ``n`` that fits MAX_GRID_COLS (n itself when small)."""
    if n <= MAX_GRID_COLS:
        return n
    return max(d for d in range(1, MAX_GRID_COLS + 1) if n % d == 0)


def coords_label(coords: Mapping[str, int], layout: ParallelLayout | None = None) -> str:
    """``tp1 dp0``: the rank's coordinates along dims of size > 1 (all dims if none)."""
    dims = [d for d in coords if layout is None or getattr(layout, d) > 1]
    return " ".join(f"{d}{coords[d]}" for d in (dims or list(coords)))


def col_label(layout: ParallelLayout, shape: GridShape, col: int) -> str:
    if not shape.row_dims and layout.world_size > shape.ncols:
        return str(col)  # a wrapped single dim: columns are offsets within the row
    coords = layout.coords(col)
    return " ".join(f"{d}{coords[d]}" for d in reversed(shape.col_dims)) or "rank"


def row_label(layout: ParallelLayout, shape: GridShape, row: int) -> str:
    first = row * shape.ncols
    if not shape.row_dims:
        if shape.nrows == 1:
            return ""
        dim = shape.col_dims[0] if shape.col_dims else "rank"
        return f"{dim} {first}-{first + shape.ncols - 1}"
    coords = layout.coords(first)
    return " ".join(f"{d}{coords[d]}" for d in reversed(shape.row_dims))


def default_color_kind(layout: ParallelLayout) -> str:
    """The fastest dim of size > 1 (tp on most layouts): its groups are the grid's rows."""
    return next((d for d in layout.dims if getattr(layout, d) > 1), layout.dims[0])


def color_kinds(layout: ParallelLayout) -> list[str]:
    """Kinds worth coloring by: groups of more than one rank that are not the whole world."""
    kinds = [k for k in layout.kinds() if 1 < layout.kind_size(k) < layout.world_size]
    return kinds or [default_color_kind(layout)]


def group_index(layout: ParallelLayout, kind: str) -> list[int]:
    """For each rank, the index of its group in ``layout.groups(kind)``."""
    index = [0] * layout.world_size
    for i, group in enumerate(layout.groups(kind)):
        for r in group:
            index[r] = i
    return index


def hosts_by_block(world_size: int, ranks_per_host: int) -> list[str]:
    """Planning: consecutive ranks share a host, ``ranks_per_host`` at a time."""
    return [f"host{r // ranks_per_host}" for r in range(world_size)]


def spanning_groups(groups: list[list[int]], hosts: Sequence[str] | None) -> set[int]:
    """Indices of groups whose ranks sit on more than one host."""
    if not hosts or len(set(hosts)) < 2:
        return set()
    return {i for i, g in enumerate(groups) if len({hosts[r] for r in g}) > 1}


def focus_kinds(layout: ParallelLayout, color_by: str) -> list[str]:
    """The kinds listed when a rank is selected: each dim of size > 1, then ``color_by``."""
    kinds = [d for d in layout.dims if getattr(layout, d) > 1]
    color_by = layout.normalize_kind(color_by)
    return kinds + ([color_by] if color_by not in kinds else [])


@dataclass(frozen=True)
class GroupTile:
    """How one rank's tile in the group grid looks; shared by the widget and static HTML."""

    rank: int
    label: str  # multi-line
    color: str
    group: int  # index of its group of the color kind
    spans_hosts: bool
    selected: bool = False
    in_selected_group: bool = False  # same color-kind group as the selected rank
    shared: tuple[str, ...] = ()  # kinds whose group it shares with the selected rank
    dim: bool = False  # a selection exists and this rank shares none of its groups


def group_tiles(
    layout: ParallelLayout,
    color_by: str,
    hosts: Sequence[str] | None = None,
    selected: int | None = None,
) -> list[GroupTile]:
    kind = layout.normalize_kind(color_by)
    index = group_index(layout, kind)
    spanning = spanning_groups(layout.groups(kind), hosts)
    multi_host = bool(hosts) and len(set(hosts)) > 1
    focus = focus_kinds(layout, kind)
    mine = {k: set(layout.group_of(selected, k)) for k in focus} if selected is not None else {}
    tiles = []
    for r in range(layout.world_size):
        shared = tuple(k for k in focus if r in mine.get(k, ())) if r != selected else ()
        lines = [f"rank {r}", coords_label(layout.coords(r), layout)]
        if multi_host:
            lines.append(hosts[r])
        if selected is not None and r != selected:
            lines.append("same " + " ".join(shared) if shared else " ")
        elif r == selected:
            lines.append("selected")
        mark = f" {SPANS_HOSTS}" if index[r] in spanning else ""
        lines[0] += mark
        tiles.append(
            GroupTile(
                rank=r,
                label="\n".join(lines),
                color=PALETTE[index[r] % len(PALETTE)],
                group=index[r],
                spans_hosts=index[r] in spanning,
                selected=r == selected,
                in_selected_group=selected is not None and r in mine[kind],
                shared=shared,
                dim=selected is not None and r != selected and not shared,
            )
        )
    return tiles


def groups_legend(layout: ParallelLayout, kind: str, hosts: Sequence[str] | None) -> str:
    """HTML: each group of ``kind`` as a color swatch and its ranks (first 32)."""
    groups = layout.groups(kind)
    spanning = spanning_groups(groups, hosts)
    items = []
    for i, g in enumerate(groups[:32]):
        mark = f" {SPANS_HOSTS}" if i in spanning else ""
        items.append(
            f'<span style="display:inline-block;margin:1px 6px 1px 0;white-space:nowrap">'
            f'<span style="display:inline-block;width:11px;height:11px;border-radius:2px;'
            f"background:{PALETTE[i % len(PALETTE)]};border:1px solid #999;"
            f'vertical-align:middle"></span> {_esc(_ranks_text(g))}{mark}</span>'
        )
    more = f" … and {len(groups) - 32} more" if len(groups) > 32 else ""
    note = (
        f'<br><span style="color:#a33">{SPANS_HOSTS} {len(spanning)} {kind} group(s) span '
        f"hosts (traffic leaves the node)</span>"
        if spanning
        else ""
    )
    return (
        f'<div style="font-size:12px"><b>{_esc(kind)} groups</b> ({len(groups)} groups of '
        f"{layout.kind_size(kind)} ranks): {''.join(items)}{more}{note}</div>"
    )


def selection_text(layout: ParallelLayout, rank: int | None, color_by: str) -> str:
    """One line per kind: the selected rank's group (plain text, also used in the widget)."""
    if rank is None:
        return "Click a rank to outline all its groups."
    coords = coords_label(layout.coords(rank), layout)
    parts = [f"{k}: {_ranks_text(layout.group_of(rank, k))}" for k in focus_kinds(layout, color_by)]
    key = f"(solid: selected, dashed: its {color_by} group, dotted: shares another group)"
    return f"rank {rank} ({coords}) is in  " + "   ".join(parts) + f"   {key}"


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"[{ranks[0]}-{ranks[-1]}]"
    if len(ranks) > 12:
        return "[" + ",".join(map(str, ranks[:12])) + ",…]"
    return "[" + ",".join(map(str, ranks)) + "]"


def _tile_css(tile: GroupTile) -> dict[str, str]:
    """Border for a tile: selected solid, its group dashed, other shared groups dotted,
    groups that span hosts red; tiles unrelated to the selection fade (``opacity``)."""
    border = "1px solid #bbb"
    if tile.selected:
        border = "3px solid #111"
    elif tile.in_selected_group:
        border = "3px dashed #111"
    elif tile.shared:
        border = "2px dotted #333"
    if tile.spans_hosts and not (tile.selected or tile.in_selected_group or tile.shared):
        border = "2px solid #c0392b"
    return {"border": border, "opacity": "0.35" if tile.dim else "1"}


def layout_html(
    layout: ParallelLayout,
    color_by: str | None = None,
    hosts: Sequence[str] | None = None,
    selected: int | None = None,
) -> str:
    """Static HTML of the rank grid (nbconvert, GitHub, ``ParallelLayout._repr_html_``)."""
    kind = layout.normalize_kind(color_by or default_color_kind(layout))
    shape = grid_shape(layout)
    tiles = group_tiles(layout, kind, hosts, selected)
    head = "".join(
        f'<th class="infini-grid-head">{_esc(col_label(layout, shape, c))}</th>'
        for c in range(shape.ncols)
    )
    rows = []
    for row in range(shape.nrows):
        cells = []
        for tile in tiles[row * shape.ncols : (row + 1) * shape.ncols]:
            css = _tile_css(tile)
            cells.append(
                f'<td><div class="infini-group-tile" data-rank="{tile.rank}" '
                f'style="background:{tile.color};border:{css["border"]};opacity:{css["opacity"]}">'
                f"{_esc(tile.label)}</div></td>"
            )
        label = _esc(row_label(layout, shape, row))
        rows.append(f'<tr><th class="infini-grid-head">{label}</th>{"".join(cells)}</tr>')
    return (
        f'{CSS}<div class="infini-groups">'
        f'<div class="infini-title">{_esc(layout.describe())}, colored by {_esc(kind)} '
        f"groups</div>"
        f'<table class="infini-static-grid"><tr><th></th>{head}</tr>{"".join(rows)}</table>'
        f"{groups_legend(layout, kind, hosts)}</div>"
    )


def layout_text(
    layout: ParallelLayout, color_by: str | None = None, hosts: Sequence[str] | None = None
) -> str:
    """The grid for terminals: ``r5 B`` is rank 5 in group B; headers give the coordinates."""
    kind = layout.normalize_kind(color_by or default_color_kind(layout))
    shape = grid_shape(layout)
    tiles = group_tiles(layout, kind, hosts)
    names = [_group_name(t.group) + (SPANS_HOSTS if t.spans_hosts else "") for t in tiles]
    cells = [f"r{t.rank} {n}" for t, n in zip(tiles, names)]
    heads = [col_label(layout, shape, c) for c in range(shape.ncols)]
    rlabels = [row_label(layout, shape, r) for r in range(shape.nrows)]
    width = max(len(x) for x in cells + heads) + 2
    lwidth = max(len(x) for x in rlabels) + 2
    lines = [f"{layout.describe()}; letters are {kind} groups"]
    lines.append(" " * lwidth + "".join(h.ljust(width) for h in heads).rstrip())
    for row, label in enumerate(rlabels):
        chunk = cells[row * shape.ncols : (row + 1) * shape.ncols]
        lines.append(label.ljust(lwidth) + "".join(c.ljust(width) for c in chunk).rstrip())
    groups = layout.groups(kind)
    listed = "  ".join(f"{_group_name(i)}={_ranks_text(g)}" for i, g in enumerate(groups[:26]))
    lines.append(f"{kind} groups: {listed}" + (" …" if len(groups) > 26 else ""))
    if any(t.spans_hosts for t in tiles):
        lines.append(f"{SPANS_HOSTS}: the group spans hosts")
    return "\n".join(lines)


def _group_name(i: int) -> str:
    """A, B, ..., Z, AA, AB, ... so text renders can name any number of groups."""
    name = ""
    i += 1
    while i:
        i, rem = divmod(i - 1, 26)
        name = chr(65 + rem) + name
    return name


# --------------------------------------------------------------------------- group grid widget


class GroupGrid(widgets.VBox):
    """The rank grid as a widget: a color-by dropdown, one button per rank, a legend and the
    selected rank's groups. ``select(rank)`` does what a click does."""

    def __init__(
        self,
        layout: ParallelLayout,
        color_by: str | None = None,
        hosts: Sequence[str] | None = None,
    ):
        self.layout_ = layout  # ``layout`` is the widget's CSS layout trait
        self.hosts = list(hosts) if hosts else None
        self.selected: int | None = None
        self.shape = grid_shape(layout)
        kind = layout.normalize_kind(color_by or default_color_kind(layout))
        options = color_kinds(layout)
        if kind not in options:
            options.append(kind)
        self.color_by = widgets.Dropdown(options=options, value=kind, description="color by")
        self.tiles = [self._make_tile(r) for r in range(layout.world_size)]
        self.legend = widgets.HTML()
        self.info = widgets.HTML()
        title = widgets.HTML(f'<div class="infini-title">{_esc(layout.describe())}</div>')
        super().__init__([widgets.HTML(CSS), title, self.color_by, self._grid(), self.legend,
                          self.info])  # fmt: skip
        self.add_class("infini-groups")
        self.color_by.observe(lambda _: self.refresh(), names="value")
        self.refresh()

    def _make_tile(self, rank: int) -> widgets.Button:
        tile = widgets.Button(layout=widgets.Layout(width="auto", height="auto"))
        tile.add_class("infini-group-tile")
        tile.on_click(lambda _b, r=rank: self.select(None if self.selected == r else r))
        return tile

    def _grid(self) -> widgets.GridBox:
        layout, shape = self.layout_, self.shape
        cells: list[widgets.Widget] = [widgets.HTML("")]
        cells += [self._head(col_label(layout, shape, c)) for c in range(shape.ncols)]
        for row in range(shape.nrows):
            cells.append(self._head(row_label(layout, shape, row)))
            cells += self.tiles[row * shape.ncols : (row + 1) * shape.ncols]
        template = f"max-content repeat({shape.ncols}, minmax(76px, 120px))"
        return widgets.GridBox(
            cells, layout=widgets.Layout(grid_template_columns=template, grid_gap="4px")
        )

    @staticmethod
    def _head(text: str) -> widgets.HTML:
        head = widgets.HTML(f'<div class="infini-grid-head">{_esc(text)}</div>')
        head.add_class("infini-grid-head")
        return head

    @property
    def kind(self) -> str:
        return self.color_by.value

    def select(self, rank: int | None) -> None:
        self.selected = rank
        self.refresh()

    def refresh(self) -> None:
        for tile, view in zip(self.tiles, self.tile_views()):
            css = _tile_css(view)
            tile.description = view.label
            tile.tooltip = f"rank {view.rank}: {self.kind} group {_group_name(view.group)}"
            tile.style.button_color = view.color
            (tile.add_class if view.dim else tile.remove_class)("infini-dim")
            tile.style.font_weight = "bold" if view.selected else "normal"
            tile.layout.border = css["border"]
        self.legend.value = groups_legend(self.layout_, self.kind, self.hosts)
        self.info.value = f'<div style="font-size:12px">{_esc(self.selection())}</div>'

    def tile_views(self) -> list[GroupTile]:
        return group_tiles(self.layout_, self.kind, self.hosts, self.selected)

    def selection(self) -> str:
        return selection_text(self.layout_, self.selected, self.kind)

    def _repr_mimebundle_(self, **kwargs) -> dict:
        bundle = super()._repr_mimebundle_(**kwargs) or {}
        bundle["text/html"] = layout_html(self.layout_, self.kind, self.hosts, self.selected)
        bundle["text/plain"] = layout_text(self.layout_, self.kind, self.hosts)
        return bundle


def layout_mimebundle(layout: ParallelLayout, **kw) -> dict:
    """For ``ParallelLayout._repr_mimebundle_``: static HTML and text (no widget, no kernel)."""
    return {"text/html": layout_html(layout, **kw), "text/plain": layout_text(layout, **kw)}


# --------------------------------------------------------------------------- rank status


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def device_label(rs: RankState) -> str:
    """``cpu`` or ``cuda:0 NVIDIA H100``."""
    if not str(rs.device).startswith("cuda"):
        return str(rs.device)
    return f"{rs.device} {rs.device_name}"


def usage_text(rs: RankState) -> str:
    """What the rank uses now, from its telemetry: ``12.1 GiB of 79.6 GiB · util 87%`` on a
    GPU, ``RSS 310.2 MiB · CPU 98%`` on a CPU; empty for a rank that is gone or not reported."""
    if rs.state in ("dead", "stopped"):  # the last numbers would be stale
        return ""
    parts = []
    if str(rs.device).startswith("cuda"):
        if rs.memory_used is not None:
            total = f" of {_bytes(rs.memory_total)}" if rs.memory_total else " used"
            parts.append(f"{_bytes(rs.memory_used)}{total}")
        if rs.gpu_util is not None:
            parts.append(f"util {rs.gpu_util:.0f}%")
    else:
        if rs.rss is not None:
            parts.append(f"RSS {_bytes(rs.rss)}")
        if rs.cpu_percent is not None:
            parts.append(f"CPU {rs.cpu_percent:.0f}%")
    return " · ".join(parts)


def device_text(rs: RankState) -> str:
    """``cpu · RSS 310.2 MiB · CPU 98%`` or ``cuda:0 NVIDIA H100 · 1.2 GiB of 79.6 GiB``."""
    return " · ".join(part for part in (device_label(rs), usage_text(rs)) if part)


def state_text(rs: RankState, busy_for: float | None = None) -> str:
    """``busy 1m05s`` once a rank has been busy a while: a long one may be stuck."""
    if rs.state == "dead" and rs.exit_code is not None:
        return f"dead (exit {rs.exit_code})"
    if rs.state == "busy" and busy_for is not None and busy_for >= BUSY_SHOWN_AFTER_S:
        minutes, seconds = divmod(int(busy_for), 60)
        return f"busy {minutes}m{seconds:02d}s" if minutes else f"busy {seconds}s"
    return rs.state


def status_tile_html(
    rs: RankState, layout: ParallelLayout | None = None, busy_for: float | None = None
) -> str:
    """One rank's status tile; the border and badge color follow its state."""
    color = STATE_COLORS.get(rs.state, "#777")
    return (
        f'<div class="infini-rank-tile infini-state-{_esc(rs.state)}" data-rank="{rs.rank}" '
        f'style="border-left-color:{color}">'
        f'<span class="infini-state" style="background:{color}">'
        f"{_esc(state_text(rs, busy_for))}</span>"
        f"<b>rank {rs.rank}</b> &nbsp;{_esc(coords_label(rs.coords, layout))}<br>"
        f'<span class="infini-muted">{_esc(rs.host)} · pid {rs.pid}</span><br>'
        f"{_esc(device_label(rs))}<br>"
        f'<span class="infini-usage">{_esc(usage_text(rs))}</span></div>'
    )


def status_summary(states: Sequence[RankState]) -> str:
    """``4 ranks: 2 busy, 2 idle``."""
    counts: dict[str, int] = {}
    for rs in states:
        counts[rs.state] = counts.get(rs.state, 0) + 1
    order = ["busy", "stuck", "error", "dead", "idle", "stopped"]
    order += sorted(s for s in counts if s not in order)  # a state added later still counts
    parts = [f"{counts[s]} {s}" for s in order if s in counts]
    return f"{len(states)} ranks: " + ", ".join(parts)


def status_html(states: Sequence[RankState], layout: ParallelLayout | None = None) -> str:
    tiles = "".join(status_tile_html(rs, layout) for rs in states)
    cols = grid_shape(layout).ncols if layout is not None else 4
    grid = f"display:grid;grid-template-columns:repeat({min(cols, 8)},max-content);gap:6px"
    return (
        f'{CSS}<div class="infini-status"><div class="infini-title">'
        f'{_esc(status_summary(states))}</div><div style="{grid}">{tiles}</div></div>'
    )


def status_text(states: Sequence[RankState], layout: ParallelLayout | None = None) -> str:
    rows = [status_summary(states)]
    rows.append(f"{'rank':>4}  {'state':<13} {'coords':<14} {'host':<16} {'pid':>7}  device")
    for rs in states:
        coords = coords_label(rs.coords, layout)
        rows.append(
            f"{rs.rank:>4}  {state_text(rs):<13} {coords:<14} {rs.host[:16]:<16} "
            f"{rs.pid:>7}  {device_text(rs)}"
        )
    return "\n".join(rows)


class StatusWidget(widgets.VBox):
    """Live rank tiles for a session: a daemon thread polls ``session.status()`` every
    ``interval`` seconds (the kernel stays free) and stops when the session stops or on
    ``close()``. ``refresh()`` does one poll by hand."""

    def __init__(self, session: Session, interval: float = 0.5, live: bool = True):
        self.session = session
        self.interval = interval
        self.layout_ = _session_layout(session)
        self.states: list[str] = []
        self._busy_since: dict[int, float] = {}  # rank -> when this widget first saw it busy
        self.summary = widgets.HTML()
        self.tiles = [widgets.HTML() for _ in range(session.world_size)]
        for tile in self.tiles:
            tile.add_class("infini-rank-tile-box")
        cols = grid_shape(self.layout_).ncols if self.layout_ is not None else 4
        grid = widgets.GridBox(
            self.tiles,
            layout=widgets.Layout(
                grid_template_columns=f"repeat({min(cols, 8)}, max-content)", grid_gap="6px"
            ),
        )
        super().__init__([widgets.HTML(CSS), self.summary, grid])
        self.add_class("infini-status")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.refresh()
        if live:
            self.start()

    def refresh(self) -> list[RankState]:
        """Poll once and update the tiles (only changed ones send anything to the browser)."""
        states = self.session.status()
        self.states = [rs.state for rs in states]
        now = time.monotonic()
        for tile, rs in zip(self.tiles, states):
            if rs.state != "busy":
                self._busy_since.pop(rs.rank, None)
            since = self._busy_since.setdefault(rs.rank, now) if rs.state == "busy" else None
            tile.value = status_tile_html(rs, self.layout_, None if since is None else now - since)
        self.summary.value = f'<div class="infini-title">{_esc(status_summary(states))}</div>'
        return states

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
            try:
                self.refresh()
            except Exception:  # a poll must never kill the kernel's display; try again
                continue
            if not self.session.running:
                return  # the last refresh showed "stopped"

    def stop(self, timeout: float = 5.0) -> None:
        """Stop polling and wait for the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def close(self) -> None:
        self.stop()
        super().close()

    def _repr_mimebundle_(self, **kwargs) -> dict:
        states = self.session.status()
        bundle = super()._repr_mimebundle_(**kwargs) or {}
        bundle["text/html"] = status_html(states, self.layout_)
        bundle["text/plain"] = status_text(states, self.layout_)
        return bundle


def _session_layout(session: Session) -> ParallelLayout | None:
    try:
        return session.layout
    except Exception:  # a plan without layout sizes: tiles still work, coords stay raw
        return None


_status_widgets: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def status_widget(session: Session, interval: float = 0.5) -> StatusWidget:
    """The session's status widget, made once and shared (``%dist_status`` and the session's
    own display show the same live tiles, like dask's cluster widget)."""
    widget = _status_widgets.get(session)
    if widget is None or widget.comm is None or (session.running and not widget.live):
        if widget is not None:
            widget.close()
        widget = StatusWidget(session, interval=interval)
        _status_widgets[session] = widget
    return widget


def close_status_widgets() -> None:
    """Stop every status widget's thread (tests, kernel shutdown)."""
    for widget in list(_status_widgets.values()):
        widget.close()
    _status_widgets.clear()


def _in_kernel() -> bool:
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

    def display(self, label: str, output: dict) -> None:
        data = output.get("data", {})
        if set(data) == {"text/plain"}:
            self.out(prefix_lines(label, data["text/plain"]))
            return
        self.out(f"{label}\n")
        self.widget.append_display_data({"data": data, "metadata": output.get("metadata", {})})


class Progress:
    """A progress bar drawn as a display updated in place (display_id): live while work
    runs, and a saved notebook keeps its last state (a saved widget reads '0%').
    Call it as ``progress(done, total, what)``; outside a kernel it stays silent."""

    WIDTH = 30

    def __init__(self, desc: str):
        self.desc = desc
        self._t0 = time.monotonic()
        self._shown_at = 0.0
        self._handle = None
        self._state = (0, 0, "")
        if _in_kernel():
            from IPython.display import display

            self._handle = display(self._bundle(), raw=True, display_id=True)

    def __call__(self, done: int, total: int, what: str = "") -> None:
        self._state = (done, total, what)
        now = time.monotonic()
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
            f'<div class="infini-progress">{_esc(self.desc)}: '
            f'<progress value="{done}" max="{max(total, 1)}" style="width:14em"></progress> '
            f"{_esc(tail)}</div>"
        )
        return {"text/plain": text, "text/html": html}


def session_mimebundle(session: Session) -> dict:
    """What a session shows as a cell's value: the live widget in a kernel, else HTML/text."""
    header = repr(session)
    if _in_kernel() and session.running:
        bundle = status_widget(session)._repr_mimebundle_()
    else:
        states = session.status()
        layout = _session_layout(session)
        bundle = {
            "text/html": status_html(states, layout),
            "text/plain": status_text(states, layout),
        }
    bundle["text/plain"] = f"{header}\n{bundle['text/plain']}"
    return bundle


# --------------------------------------------------------------------------- benchmarks

FIGURE_DPI = 100
METRICS = {"busbw_gbps": "busbw (GB/s)", "algbw_gbps": "algbw (GB/s)"}


def size_label(n: float) -> str:
    """1024 -> 1K, 4194304 -> 4M (powers of two, as nccl-tests prints sizes)."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{n:.0f}"


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
    from matplotlib.figure import Figure

    collectives = [collective] if collective else list(dict.fromkeys(df["collective"]))
    ncols = min(3, max(1, len(collectives)))
    nrows = math.ceil(len(collectives) / ncols) if collectives else 1
    fig = Figure(figsize=(4.6 * ncols, 3.3 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, name in zip(axes, collectives):
        _plot_curves(ax, bench_curves(df, name, metric, group), metric)
        ax.set_title(name)
    for ax in axes[len(collectives) :]:
        ax.set_visible(False)
    if not collectives:
        axes[0].text(0.5, 0.5, "no benchmark rows", ha="center", va="center")
    return fig


def _plot_curves(ax, curves: dict[str, pd.DataFrame], metric: str) -> None:
    for i, (name, c) in enumerate(curves.items()):
        color = f"C{i}"
        ax.plot(c["size_bytes"], c["mean"], marker="o", ms=3, label=name, color=color)
        if (c["max"] > c["min"]).any():
            ax.fill_between(c["size_bytes"], c["min"], c["max"], alpha=0.2, color=color)
    ax.set_xscale("log", base=2)
    if all((c["min"] > 0).all() for c in curves.values()) and curves:
        ax.set_yscale("log")  # small messages are orders of magnitude slower
    ax.xaxis.set_major_formatter(_size_formatter())
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel(METRICS.get(metric, metric))
    ax.grid(True, which="both", alpha=0.3)
    if curves:
        ax.legend(title="group", fontsize=8, title_fontsize=8)


def _size_formatter():
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda x, _pos: size_label(x))


def p2p_heatmap(
    matrix: Any, title: str | None = None, hosts: Sequence[str] | None = None
) -> Figure:
    """Sender x receiver bandwidth (``bench.run_p2p``'s src x dst DataFrame, or any square
    array; NaN diagonal left blank): a slow link is a dark cell, a slow rank a dark row and
    column. Values are printed in the cells up to 16 ranks. ``hosts`` (one per rank): white
    lines fence each host's block, so intra-node pairs sit on the diagonal blocks."""
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
    if hosts is not None and len(set(hosts)) > 1:
        for i in range(n - 1):
            if hosts[i] != hosts[i + 1]:
                ax.axhline(i + 0.5, color="white", linewidth=2)
                ax.axvline(i + 0.5, color="white", linewidth=2)
    if n <= 16 and np.isfinite(values).any():
        top = np.nanmax(values)
        for (i, j), v in np.ndenumerate(values):
            if np.isfinite(v):
                color = "black" if v > 0.6 * top else "white"
                ax.text(j, i, f"{v:.2g}", ha="center", va="center", fontsize=7, color=color)
    return fig


def figure_png(fig: Figure, dpi: int = FIGURE_DPI) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def figure_html(fig: Figure) -> str:
    data = base64.b64encode(figure_png(fig)).decode()
    return f'<img class="infini-figure" src="data:image/png;base64,{data}">'


def bench_summary(df: pd.DataFrame, metric: str = "busbw_gbps") -> pd.DataFrame:
    """Peak ``metric`` per collective and group, with the size it was reached at."""
    best = df.loc[df.groupby(["collective", "group"], sort=False)[metric].idxmax()]
    out = best[["collective", "group", "group_size", "size_bytes", metric]].copy()
    out["size"] = out["size_bytes"].map(size_label)
    return out.drop(columns="size_bytes").reset_index(drop=True)


class BenchView(widgets.VBox):
    """Benchmark rows as a widget: pick the collective and group kind, busbw or algbw; the
    figure (a PNG image widget) redraws on each change. ``p2p``: optional sender x receiver
    matrix shown as a heatmap below."""

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
        self.image = widgets.Image(format="png")
        self.image.add_class("infini-figure")
        self.figure: Figure | None = None
        children = [widgets.HBox([self.collective, self.group, self.metric]), self.image]
        if p2p is not None:
            heat_fig = p2p_heatmap(p2p)
            heat = widgets.Image(value=figure_png(heat_fig), format="png")
            heat.layout.width = f"{int(heat_fig.get_figwidth() * FIGURE_DPI)}px"
            heat.add_class("infini-figure")
            children.append(heat)
        super().__init__(children)
        self.add_class("infini-bench")
        for control in (self.collective, self.group, self.metric):
            control.observe(lambda _: self.redraw(), names="value")
        self.redraw()

    def redraw(self) -> None:
        self.figure = plot_busbw(
            self.df, self.collective.value, self.metric.value, self.group.value
        )
        self.image.value = figure_png(self.figure)
        width = int(self.figure.get_figwidth() * FIGURE_DPI)
        self.image.layout.width = f"{width}px"  # natural size: a stretched PNG reads badly

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
