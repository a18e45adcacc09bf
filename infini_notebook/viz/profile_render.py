"""``%%dist_profile``'s result as a user reads it (pure: DataFrames and strings in, HTML and
text out): the verdict first, then the figure, then each table under a caption that says
what its columns mean, rounded (the DataFrames keep full precision), then where the files
are, with Perfetto as a link."""

from __future__ import annotations

import re
import textwrap
from typing import TYPE_CHECKING

from .render import esc, text_table

if TYPE_CHECKING:
    import pandas as pd

PERFETTO = "https://ui.perfetto.dev"
WIDTH = 100  # text lines are wrapped here, between words (JupyterLab breaks them anywhere)
WORST = 10  # the collectives shown: those that made the others wait most

RANKS_CAPTION = (
    "Each rank's cell (ms): compute + communication + wait + idle = wall. wait: inside a "
    "collective or message until its last peer arrived; ops: the rank's collectives and "
    "messages in the cell, matched: those seen on every member (wait covers those); "
    "waited_for: the rank where most of its wait started, and the ranks it came through "
    "(each waiting for the one before); "
    "top_ops: the ops that took its compute time (self time), with their share of it."
)
COLLECTIVES_CAPTION = (
    "The {shown} that made the others wait most, of {total} in the cell (ms). n: its number "
    "in the cell (a group's collectives, a pair's messages, from 1); ranks: its members; "
    "last_rank: who arrived "
    "last; arrival_spread_ms: from the first arrival to the last; wait_caused_ms: the "
    "members' wait for the last, summed; at_ms: the first arrival, from the cell's start."
)
SHOWN_COLLECTIVE_COLUMNS = [
    "n", "collective", "group", "ranks", "last_rank", "arrival_spread_ms", "wait_caused_ms",
    "at_ms",
]  # fmt: skip


def worst(collectives: pd.DataFrame, n: int = WORST) -> pd.DataFrame:
    """The collectives that cost the others the most waiting."""
    if not len(collectives):
        return collectives
    return collectives.sort_values("wait_caused_ms", ascending=False).head(n)


def shown(df: pd.DataFrame, columns: list[str] | None = None) -> pd.DataFrame:
    """``df`` as shown: ms to 0.1, a wait that was not measured left empty (never 0)."""
    out = (df[columns] if columns and len(df) else df).astype(object)
    for col in out.columns:
        if str(col).endswith("_ms"):
            out[col] = [f"{v:.1f}" if v == v and v is not None else "" for v in df[col]]
    return out


def unbroken_items(text: str) -> str:
    """``aten::mm 62 %, aten::add_ 20 %`` with each item's spaces made non-breaking: the
    browser wraps a top_ops cell between items, never inside one ("62" / "%")."""
    return ", ".join(item.replace(" ", "\u00a0") for item in text.split(", "))


def tables(ranks: pd.DataFrame, collectives: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """(caption, table as shown) for each table."""
    top = worst(collectives)
    caption = COLLECTIVES_CAPTION.format(
        shown="collective" if len(top) == 1 else f"{len(top)} collectives", total=len(collectives)
    )
    return [(RANKS_CAPTION, shown(ranks)), (caption, shown(top, SHOWN_COLLECTIVE_COLUMNS))]


def files_line(n: int, size: str, folder: str, partial: str = "") -> str:
    return (
        f"{n} rank traces ({size}) in {folder}/: merged.json opens in {PERFETTO} or "
        f"chrome://tracing, one track per rank{partial}"
    )


def wrap(text: str, width: int = WIDTH) -> str:
    """Each line of ``text`` wrapped between words (a path or a link is never cut)."""
    return "\n".join(
        textwrap.fill(line, width, break_long_words=False, break_on_hyphens=False) or line
        for line in text.split("\n")
    )


def linked(text: str) -> str:
    """``text`` as HTML, its Perfetto address a link."""
    return re.sub(
        re.escape(PERFETTO),
        f'<a href="{PERFETTO}" target="_blank" rel="noopener">{PERFETTO}</a>',
        esc(text),
    )


def profile_text(verdict: str, ranks, collectives, summary: str) -> str:
    """The verdict, where the files are, and the tables under their captions."""
    parts = [wrap(verdict), wrap(summary)]
    for caption, table in tables(ranks, collectives):
        if len(table):
            rows = table.values.tolist()
            parts.append(f"{wrap(caption)}\n{text_table(rows, list(table.columns))}")
    return "\n\n".join(parts)


def profile_html(verdict: str, ranks, collectives, figure: str, summary: str) -> str:
    """The verdict in bold, the figure, where the files are (Perfetto a link), the tables
    with their captions."""
    out = [f'<p class="infini-verdict"><b>{esc(verdict)}</b></p>', figure]
    out += [f"<p>{linked(line)}</p>" for line in summary.split("\n")]
    for caption, table in tables(ranks, collectives):
        if len(table):
            if "top_ops" in table:
                table = table.assign(top_ops=[unbroken_items(t) for t in table["top_ops"]])
            html = table.to_html(index=False, classes="infini-profile-table")
            head, rest = html.split(">", 1)
            out.append(f'{head}><caption style="text-align:left">{esc(caption)}</caption>{rest}')
    return "".join(out)
