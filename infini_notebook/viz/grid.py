"""``GroupGrid``: the rank grid of a ``ParallelLayout`` as a widget, colored by one kind's
groups; clicking a rank outlines every group it belongs to. Works without a session, for
planning. Its look comes from the pure ``render`` module, which also gives its static HTML."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import ipywidgets as widgets

from .render import (
    CSS,
    GroupTile,
    col_label,
    color_kinds,
    default_color_kind,
    esc,
    grid_shape,
    group_name,
    group_tiles,
    groups_legend,
    layout_html,
    layout_text,
    row_label,
    selection_text,
    tile_css,
)

if TYPE_CHECKING:
    from ..core.layout import ParallelLayout


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
        title = widgets.HTML(f'<div class="infini-title">{esc(layout.describe())}</div>')
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
        head = widgets.HTML(f'<div class="infini-grid-head">{esc(text)}</div>')
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
            css = tile_css(view)
            tile.description = view.label
            kind = self.layout_.kind_label(self.kind)
            tile.tooltip = f"rank {view.rank}: {kind} group {group_name(view.group)}"
            tile.style.button_color = view.color
            (tile.add_class if view.dim else tile.remove_class)("infini-dim")
            tile.style.font_weight = "bold" if view.selected else "normal"
            tile.layout.border = css["border"]
        self.legend.value = groups_legend(self.layout_, self.kind, self.hosts)
        self.info.value = f'<div style="font-size:12px">{esc(self.selection())}</div>'

    def tile_views(self) -> list[GroupTile]:
        return group_tiles(self.layout_, self.kind, self.hosts, self.selected)

    def selection(self) -> str:
        return selection_text(self.layout_, self.selected, self.kind)

    def _repr_mimebundle_(self, **kwargs) -> dict:
        bundle = super()._repr_mimebundle_(**kwargs) or {}
        bundle["text/html"] = layout_html(self.layout_, self.kind, self.hosts, self.selected)
        bundle["text/plain"] = layout_text(self.layout_, self.kind, self.hosts)
        return bundle
