"""Pure renderers: CSS, colors, escaping, byte sizes, the rank grid's shape and tiles, and the
static HTML and text of a ``ParallelLayout`` (nbconvert, GitHub, terminals,
``ParallelLayout._repr_html_``). Pure: no ipywidgets, IPython or matplotlib, so showing a
layout stays light; the widgets in ``grid``/``status`` only map these onto ipywidgets, and tests
check them without a browser.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..core.ranks import format_ranks
from ..core.transcript import WIDGET_MIME as WIDGET_MIME  # viz.WIDGET_MIME


class LayoutLike(Protocol):
    """What the renderers read of a ``layout.ParallelLayout``. Duck-typed, so this module never
    imports ``layout``: the layout imports it for its own HTML repr."""

    world_size: int

    @property
    def dims(self) -> tuple[str, ...]: ...
    @property
    def active_dims(self) -> tuple[str, ...]: ...
    def describe(self) -> str: ...
    def coords(self, rank: int) -> dict[str, int]: ...
    def kinds(self) -> list[str]: ...
    def normalize_kind(self, kind: str) -> str: ...
    def kind_label(self, kind: str) -> str: ...
    def kind_size(self, kind: str) -> int: ...
    def groups(self, kind: str) -> list[list[int]]: ...
    def group_of(self, rank: int, kind: str) -> list[int]: ...


# Soft colors so black text stays readable; neighbouring groups get clearly different hues.
PALETTE = (
    "#8dd3c7", "#fdb462", "#bebada", "#fb8072", "#80b1d3", "#b3de69", "#fccde5", "#ffed6f",
    "#bc80bd", "#ccebc5", "#a6cee3", "#fdbf6f", "#cab2d6", "#b2df8a", "#fb9a99", "#e5d8bd",
)  # fmt: skip
MAX_GRID_COLS = 16  # a single wide dim wraps into rows of at most this many ranks
SPANS_HOSTS = "⇄"  # marks tiles whose group crosses a host boundary

# Colors follow the notebook's theme: JupyterLab's variables, then VS Code's, then a light
# fallback (classic Notebook). Text keeps 4.5:1 contrast in JupyterLab's light and dark
# themes (tests/test_browser.py reads the computed styles); group tiles keep their pastel
# backgrounds, so their text is dark in every theme.
FG = "var(--jp-ui-font-color1, var(--vscode-editor-foreground, #222))"
FG_MUTED = "var(--jp-ui-font-color2, var(--vscode-descriptionForeground, #555))"
BG = "var(--jp-layout-color1, var(--vscode-editor-background, #fff))"
BORDER = "var(--jp-border-color1, var(--vscode-panel-border, #ccc))"
CSS = f"""
<style>
.infini-rank-tile {{ font-family: var(--jp-ui-font-family, sans-serif); font-size: 12px;
  line-height: 1.35; padding: 5px 8px; border-radius: 6px; border: 1px solid {BORDER};
  border-left-width: 7px; background: {BG}; color: {FG}; min-width: 200px; }}
.infini-rank-tile .infini-state {{ float: right; margin-left: 8px; font-weight: 600;
  color: #fff; padding: 0 6px; border-radius: 8px; font-size: 11px; }}
.infini-rank-tile .infini-muted, .infini-rank-tile .infini-note {{ color: {FG_MUTED}; }}
.infini-rank-tile .infini-usage {{ font-variant-numeric: tabular-nums; }}
.infini-group-tile.jupyter-button {{ white-space: pre; height: auto; line-height: 1.35;
  padding: 6px 4px; font-size: 12px; border-radius: 6px; color: #111 !important; }}
.infini-group-tile.infini-dim, .infini-group-tile.jupyter-button.infini-dim {{
  background: {BG} !important; color: {FG} !important; font-weight: normal; }}
.infini-grid-head {{ font-size: 12px; color: {FG}; font-weight: 600; text-align: center;
  align-self: center; }}
.infini-title {{ font-size: 13px; font-weight: 600; margin: 2px 0 4px 0; color: {FG}; }}
.infini-static-grid td {{ padding: 2px; text-align: center; }}
.infini-warn {{ color: var(--jp-error-color1, #b3261e); }}
.infini-static-grid .infini-group-tile {{ white-space: pre; padding: 6px 10px; color: #111;
  border-radius: 6px; font-size: 12px; line-height: 1.35; border: 1px solid #bbb; }}
</style>
"""


def esc(value: Any) -> str:
    return html.escape(str(value))


# Largest unit first; "iec" for memory (``1.5 GiB``), "nccl" for message sizes as nccl-tests
# prints them (``4K``, ``1M``).
_BYTE_UNITS = {
    "iec": ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")),
    "nccl": ((1 << 30, "G"), (1 << 20, "M"), (1 << 10, "K")),
}


def format_bytes(n: float, style: str = "iec") -> str:
    """``310.0 MiB`` (style "iec") or ``4K`` / ``1.5M`` (style "nccl"); powers of two."""
    scale, unit = next(((s, u) for s, u in _BYTE_UNITS[style] if n >= s), (1, ""))
    value = n / scale
    if style == "iec":
        return f"{value:.1f} {unit}" if unit else f"{n:.0f} B"
    whole = value == int(value) or not unit  # below 1K nccl-tests prints whole bytes
    return f"{value:.0f}{unit}" if whole else f"{value:.1f}{unit}"


def size_label(n: float) -> str:
    """1024 -> 1K, 4194304 -> 4M (powers of two, as nccl-tests prints sizes)."""
    return format_bytes(n, "nccl")


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


def grid_shape(layout: LayoutLike) -> GridShape:
    """Split the non-trivial dims (fastest first) where the grid is closest to square,
    preferring wide; a prefix split keeps ranks in reading order (rank = row*ncols + col)."""
    dims = list(layout.active_dims)
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


def coords_label(coords: Mapping[str, int], layout: LayoutLike | None = None) -> str:
    """``tp1 dp0``: the rank's coordinates along dims of size > 1 (all dims if none)."""
    dims = [d for d in coords if layout is None or d in layout.active_dims]
    return " ".join(f"{d}{coords[d]}" for d in (dims or list(coords)))


def col_label(layout: LayoutLike, shape: GridShape, col: int) -> str:
    """What a column's ranks share: their rank within each column dim's group ('tp rank 1':
    a position in every tp group, not a tp group; those are the rows)."""
    if not shape.row_dims and layout.world_size > shape.ncols:
        return str(col)  # a wrapped single dim: columns are offsets within the row
    return positions(layout.coords(col), shape.col_dims) or "rank"


def row_label(layout: LayoutLike, shape: GridShape, row: int) -> str:
    first = row * shape.ncols
    if not shape.row_dims:
        if shape.nrows == 1:
            return ""
        dim = shape.col_dims[0] if shape.col_dims else "rank"
        return f"{dim} {first}-{first + shape.ncols - 1}"
    return positions(layout.coords(first), shape.row_dims)


def positions(coords: Mapping[str, int], dims: Sequence[str]) -> str:
    """'pp rank 1, dp rank 0': the rank within each dim's group, slowest dim first."""
    return ", ".join(f"{d} rank {coords[d]}" for d in reversed(dims))


def default_color_kind(layout: LayoutLike) -> str:
    """The fastest dim of size > 1 (tp on most layouts): its groups are the grid's rows."""
    return next(iter(layout.active_dims), layout.dims[0])


def color_kinds(layout: LayoutLike) -> list[str]:
    """Kinds worth coloring by: groups of more than one rank that are not the whole world,
    made of dims of size > 1 only (with cp = pp = 1, "tp-cp" is "tp" under another name)."""
    kinds = [
        k
        for k in layout.kinds()
        if 1 < layout.kind_size(k) < layout.world_size
        and all(layout.kind_size(d) > 1 for d in k.split("-"))
    ]
    return kinds or [default_color_kind(layout)]


def group_index(layout: LayoutLike, kind: str) -> list[int]:
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


def focus_kinds(layout: LayoutLike, color_by: str) -> list[str]:
    """The kinds listed when a rank is selected: each dim of size > 1, then ``color_by``."""
    kinds = list(layout.active_dims)
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
    layout: LayoutLike,
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


def groups_legend(layout: LayoutLike, kind: str, hosts: Sequence[str] | None) -> str:
    """HTML: each group of ``kind`` as a color swatch and its ranks (first 32)."""
    groups = layout.groups(kind)
    label = layout.kind_label(kind)
    spanning = spanning_groups(groups, hosts)
    items = []
    for i, g in enumerate(groups[:32]):
        mark = f" {SPANS_HOSTS}" if i in spanning else ""
        items.append(
            f'<span style="display:inline-block;margin:1px 6px 1px 0;white-space:nowrap">'
            f'<span style="display:inline-block;width:11px;height:11px;border-radius:2px;'
            f"background:{PALETTE[i % len(PALETTE)]};border:1px solid #999;"
            f'vertical-align:middle"></span> {esc(_ranks_text(g))}{mark}</span>'
        )
    more = f" … and {len(groups) - 32} more" if len(groups) > 32 else ""
    note = (
        f'<br><span class="infini-warn">{SPANS_HOSTS} {len(spanning)} {label} group(s) span '
        f"hosts (traffic leaves the node)</span>"
        if spanning
        else ""
    )
    return (
        f'<div style="font-size:12px"><b>{esc(label)} groups</b> ({len(groups)} groups of '
        f"{layout.kind_size(kind)} ranks): {''.join(items)}{more}{note}</div>"
    )


def selection_text(layout: LayoutLike, rank: int | None, color_by: str) -> str:
    """One line per kind: the selected rank's group (plain text, also used in the widget)."""
    if rank is None:
        return "Click a rank to outline all its groups."
    coords = coords_label(layout.coords(rank), layout)
    parts = [f"{k}: {_ranks_text(layout.group_of(rank, k))}" for k in focus_kinds(layout, color_by)]
    label = layout.kind_label(color_by)
    key = f"(solid: selected, dashed: its {label} group, dotted: shares another group)"
    return f"rank {rank} ({coords}) is in  " + "   ".join(parts) + f"   {key}"


def _ranks_text(ranks: list[int]) -> str:
    """``[0-3]``, ``[4,5]``, ``[0,4,8,…]``: a group as legends list it (``format_ranks``; a
    pair stays ``4,5``, and a long strided group is cut after 12 parts)."""
    parts = [str(r) for r in ranks] if len(ranks) == 2 else format_ranks(ranks).split(",")
    more = ",…" if len(parts) > 12 else ""
    return "[" + ",".join(parts[:12]) + more + "]"


def tile_css(tile: GroupTile) -> dict[str, str]:
    """Border and colors of a tile: selected solid, its group dashed, other shared groups
    dotted, groups that span hosts red. A tile unrelated to the selection steps back: the
    theme's background and text (readable in any theme, where a faded pastel was not in a
    dark one), its group's color kept as a dashed border."""
    border = "1px solid #bbb"
    if tile.selected:
        border = "3px solid #111"
    elif tile.in_selected_group:
        border = "3px dashed #111"
    elif tile.shared:
        border = "2px dotted #333"
    elif tile.dim:
        border = f"2px dashed {tile.color}"
    if tile.spans_hosts and not (tile.selected or tile.in_selected_group or tile.shared):
        border = "2px solid #c0392b"
    if tile.dim:
        return {"border": border, "background": BG, "color": FG}
    return {"border": border, "background": tile.color, "color": "#111"}


def layout_html(
    layout: LayoutLike,
    color_by: str | None = None,
    hosts: Sequence[str] | None = None,
    selected: int | None = None,
) -> str:
    """Static HTML of the rank grid (nbconvert, GitHub, ``ParallelLayout._repr_html_``)."""
    kind = layout.normalize_kind(color_by or default_color_kind(layout))
    shape = grid_shape(layout)
    tiles = group_tiles(layout, kind, hosts, selected)
    head = "".join(
        f'<th class="infini-grid-head">{esc(col_label(layout, shape, c))}</th>'
        for c in range(shape.ncols)
    )
    rows = []
    for row in range(shape.nrows):
        cells = []
        for tile in tiles[row * shape.ncols : (row + 1) * shape.ncols]:
            css = tile_css(tile)
            dim = " infini-dim" if tile.dim else ""
            cells.append(
                f'<td><div class="infini-group-tile{dim}" data-rank="{tile.rank}" '
                f'style="background:{css["background"]};color:{css["color"]};'
                f'border:{css["border"]}">{esc(tile.label)}</div></td>'
            )
        label = esc(row_label(layout, shape, row))
        rows.append(f'<tr><th class="infini-grid-head">{label}</th>{"".join(cells)}</tr>')
    return (
        f'{CSS}<div class="infini-groups">'
        f'<div class="infini-title">{esc(layout.describe())}, colored by {esc(kind)} '
        f"groups</div>"
        f'<table class="infini-static-grid"><tr><th></th>{head}</tr>{"".join(rows)}</table>'
        f"{groups_legend(layout, kind, hosts)}</div>"
    )


def layout_text(
    layout: LayoutLike, color_by: str | None = None, hosts: Sequence[str] | None = None
) -> str:
    """The grid for terminals: ``r5 B`` is rank 5 in group B; headers give the coordinates."""
    kind = layout.normalize_kind(color_by or default_color_kind(layout))
    shape = grid_shape(layout)
    tiles = group_tiles(layout, kind, hosts)
    names = [group_name(t.group) + (SPANS_HOSTS if t.spans_hosts else "") for t in tiles]
    cells = [f"r{t.rank} {n}" for t, n in zip(tiles, names)]
    heads = [col_label(layout, shape, c) for c in range(shape.ncols)]
    rlabels = [row_label(layout, shape, r) for r in range(shape.nrows)]
    width = max(len(x) for x in cells + heads) + 2
    lwidth = max(len(x) for x in rlabels) + 2
    lines = [f"{layout.describe()}; letters are {layout.kind_label(kind)} groups"]
    lines.append(" " * lwidth + "".join(h.ljust(width) for h in heads).rstrip())
    for row, label in enumerate(rlabels):
        chunk = cells[row * shape.ncols : (row + 1) * shape.ncols]
        lines.append(label.ljust(lwidth) + "".join(c.ljust(width) for c in chunk).rstrip())
    groups = layout.groups(kind)
    listed = "  ".join(f"{group_name(i)}={_ranks_text(g)}" for i, g in enumerate(groups[:26]))
    lines.append(f"{layout.kind_label(kind)} groups: {listed}" + (" …" if len(groups) > 26 else ""))
    if any(t.spans_hosts for t in tiles):
        lines.append(f"{SPANS_HOSTS}: the group spans hosts")
    return "\n".join(lines)


def group_name(i: int) -> str:
    """A, B, ..., Z, AA, AB, ... so text renders can name any number of groups."""
    name = ""
    i += 1
    while i:
        i, rem = divmod(i - 1, 26)
        name = chr(65 + rem) + name
    return name


def text_table(rows: Sequence[Sequence[Any]], columns: Sequence[str], missing: str = "") -> str:
    """A table for terminals and text outputs: columns two spaces apart, each header over its
    values, text left-aligned and numbers right-aligned (pandas' ``to_string`` right-aligns
    text too, so a header stood over the end of the column before it when values had
    spaces). ``missing`` stands for None and NaN."""
    cells = [[missing if _missing(v) else str(v) for v in row] for row in rows]  # "" stays
    right = [
        bool(rows) and all(_missing(row[i]) or _is_number(row[i]) for row in rows)
        for i in range(len(columns))
    ]
    widths = [max([len(str(c))] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if r else v.ljust(w) for v, w, r in zip(values, widths, right)]
        return "  ".join(parts).rstrip()

    return "\n".join([line([str(c) for c in columns])] + [line(row) for row in cells])


def _missing(value: Any) -> bool:
    return value is None or value == "" or (isinstance(value, float) and value != value)


def _is_number(value: Any) -> bool:
    """A number, or the text of one ("12.5": tables round their figures to text first)."""
    if isinstance(value, bool):
        return False
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def table_bundle(df: Any, missing: str = "-") -> dict:
    """A DataFrame shown as a table of its rows only: no index column (its 0, 1, ... mean
    nothing to a reader), ``missing`` where a value is NaN or None."""
    return {
        "text/html": df.to_html(index=False, na_rep=missing),
        "text/plain": df.to_string(index=False, na_rep=missing),
    }


def layout_mimebundle(layout: LayoutLike, **kw) -> dict:
    """For ``ParallelLayout._repr_mimebundle_``: static HTML and text (no widget, no kernel)."""
    return {"text/html": layout_html(layout, **kw), "text/plain": layout_text(layout, **kw)}
