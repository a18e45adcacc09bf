"""Pure renderers of rank status: a rank's tile, device and usage text, the summary line, and
the static HTML and text of all ranks (what ``StatusWidget`` shows, and what a saved notebook
or a terminal keeps). Fed ``RankState`` snapshots; no ipywidgets, no IPython.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..core.devices import sharing_text
from .render import CSS, coords_label, esc, format_bytes, grid_shape, text_table

if TYPE_CHECKING:
    from ..core.layout import ParallelLayout
    from ..core.state import RankState

# Badges carry white text: every color keeps WCAG's 4.5:1 against it (tests/test_viz.py).
STATE_COLORS = {
    "idle": "#1f7a3a",
    "busy": "#8a5a00",
    "prompt": "#1f5fa8",  # waiting at an input box for the user (pdb, input())
    "paused": "#1f5fa8",  # at a breakpoint of JupyterLab's debugger (kernel/debug_proxy.py)
    "failed": "#c0302f",  # raised in its last cell
    "released": "#a34a12",  # freed from a wait on a rank that failed
    "stuck": "#8e44ad",  # ignored an interrupt; busy until the collective timeout
    "died": "#444444",
    "stopped": "#6e6e6e",
}
# a state's name as a tile and the summary say it
STATE_WORDS = {"prompt": "at a prompt", "paused": "paused in the debugger"}
BUSY_SHOWN_AFTER_S = 3  # from then on a busy tile shows for how long
TILE_MIN_PX = 230  # a tile's least width: its min-width (200 px) with padding and borders
TILE_PX = 300  # its width where the output has room for a row of the layout
TILE_GAP_PX = 6


def device_label(rs: RankState) -> str:
    """``cpu`` or ``cuda:0 NVIDIA H100``."""
    if not str(rs.device).startswith("cuda"):
        return str(rs.device)
    physical = f" (GPU {rs.gpu})" if rs.gpu is not None else ""
    return f"{rs.device}{physical} {rs.device_name}"


def usage_text(rs: RankState) -> str:
    """What the rank uses now, from its telemetry: ``12.1 GiB of 79.6 GiB · util 87%`` on a
    GPU, ``RSS 310.2 MiB · CPU 98%`` on a CPU; empty for a rank that is gone or not reported."""
    if rs.state in ("died", "stopped"):  # the last numbers would be stale
        return ""
    parts = []
    if str(rs.device).startswith("cuda"):
        if rs.memory_used is not None:
            total = f" of {format_bytes(rs.memory_total)}" if rs.memory_total else " used"
            parts.append(f"{format_bytes(rs.memory_used)}{total}")
        if rs.gpu_util is not None:
            parts.append(f"util {rs.gpu_util:.0f}%")
    else:
        if rs.rss is not None:
            parts.append(f"RSS {format_bytes(rs.rss)}")
        if rs.cpu_percent is not None:
            parts.append(f"CPU {rs.cpu_percent:.0f}%")
    return " · ".join(parts)


def device_text(rs: RankState) -> str:
    """``cpu · RSS 310.2 MiB · CPU 98%`` or ``cuda:0 NVIDIA H100 · 1.2 GiB of 79.6 GiB``."""
    return " · ".join(part for part in (device_label(rs), usage_text(rs)) if part)


def state_text(rs: RankState, busy_for: float | None = None) -> str:
    """``busy 1m05s`` once a rank has been busy a while: a long one may be stuck."""
    if rs.state == "died" and rs.exit_code is not None:
        return f"died (exit {rs.exit_code})"
    if rs.state == "busy" and busy_for is not None and busy_for >= BUSY_SHOWN_AFTER_S:
        minutes, seconds = divmod(int(busy_for), 60)
        return f"busy {minutes}m{seconds:02d}s" if minutes else f"busy {seconds}s"
    return STATE_WORDS.get(rs.state, rs.state)


def status_tile_html(
    rs: RankState, layout: ParallelLayout | None = None, busy_for: float | None = None
) -> str:
    """One rank's status tile; the border and badge color follow its state."""
    color = STATE_COLORS.get(rs.state, "#777")
    return (
        f'<div class="infini-rank-tile infini-state-{esc(rs.state)}" data-rank="{rs.rank}" '
        f'style="border-left-color:{color}">'
        f'<span class="infini-state" style="background:{color}">'
        f"{esc(state_text(rs, busy_for))}</span>"
        f"<b>rank {rs.rank}</b> &nbsp;{esc(coords_label(rs.coords, layout))}<br>"
        f'<span class="infini-muted">{esc(rs.host)} · pid {rs.pid}</span><br>'
        f"{esc(device_label(rs))}<br>"
        f'<span class="infini-usage">{esc(usage_text(rs))}</span>'
        + (f'<br><span class="infini-note">{esc(rs.note)}</span>' if rs.note else "")
        + "</div>"
    )


def status_summary(
    states: Sequence[RankState],
    template_rss: int | None = None,
    spares: int = 0,
    session_line: str = "",
) -> str:
    """``session ready · 4 ranks: 2 busy, 2 idle``, the warm template's memory while it runs
    (``· warm template RSS 310.2 MiB``) and the spare engines a hard restart left."""
    counts: dict[str, int] = {}
    for rs in states:
        counts[rs.state] = counts.get(rs.state, 0) + 1
    order = ["prompt", "paused", "busy", "stuck", "failed", "released", "died", "idle", "stopped"]
    order += sorted(s for s in counts if s not in order)  # a state added later still counts
    parts = [f"{counts[s]} {STATE_WORDS.get(s, s)}" for s in order if s in counts]
    template = f" · warm template RSS {format_bytes(template_rss)}" if template_rss else ""
    spare = f" · {spares} spare engines for the next hard restart" if spares else ""
    session = f"session {session_line} · " if session_line else ""
    shared = _shared_gpus(states)
    shared = f" · {shared}" if shared else ""
    return f"{session}{_ranks(len(states))}: " + ", ".join(parts) + shared + template + spare


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def _shared_gpus(rows: Sequence[RankState]) -> str:
    """'GPU 0: ranks 0-1, shared: correctness, not speed' where ranks share a GPU."""
    gpus = [rs.gpu for rs in rows]
    return sharing_text(gpus) if None not in gpus else ""


def tiles_grid(cols: int) -> dict[str, str]:
    """The tiles' CSS grid: a row holds the layout's columns (at most 8) where the output is
    wide enough, and fewer, each tile at least TILE_MIN_PX wide, where it is not (a
    debugger panel open): tiles move to the next row, never cut off. A fixed column count
    overflowed a narrow output."""
    n = max(1, min(cols, 8))
    gaps = TILE_GAP_PX * (n - 1)
    least = f"max({TILE_MIN_PX}px, calc((100% - {gaps}px) / {n}))"  # n per row at most
    return {
        "display": "grid",
        "grid-template-columns": f"repeat(auto-fill, minmax({least}, 1fr))",
        "gap": f"{TILE_GAP_PX}px",
        "max-width": f"{n * TILE_PX + gaps}px",
    }


def status_html(
    states: Sequence[RankState],
    layout: ParallelLayout | None = None,
    template_rss: int | None = None,
    spares: int = 0,
    session_line: str = "",
) -> str:
    tiles = "".join(status_tile_html(rs, layout) for rs in states)
    cols = grid_shape(layout).ncols if layout is not None else 4
    grid = ";".join(f"{k}:{v}" for k, v in tiles_grid(cols).items())
    summary = status_summary(states, template_rss, spares, session_line)
    return (
        f'{CSS}<div class="infini-status"><div class="infini-title">'
        f'{esc(summary)}</div><div style="{grid}">{tiles}</div></div>'
    )


def status_text(
    states: Sequence[RankState],
    layout: ParallelLayout | None = None,
    template_rss: int | None = None,
    spares: int = 0,
    session_line: str = "",
) -> str:
    columns = ["rank", "state", "coords", "host", "pid", "device"]
    rows = [
        [rs.rank, state_text(rs), coords_label(rs.coords, layout), rs.host, rs.pid,
         device_text(rs) + (f"  ({rs.note})" if rs.note else "")]
        for rs in states
    ]  # fmt: skip
    summary = status_summary(states, template_rss, spares, session_line)
    return f"{summary}\n{text_table(rows, columns)}"


def ready_text(
    backend: str, rows: Sequence[RankState], how: str, layout: str = "", kept: str = ""
) -> str:
    """%dist_start's line: '4 ranks ready (tp 2 x dp 2; nccl; GPUs 4,5,6,7; 8 threads per
    rank; how).' ``layout``: ``ParallelLayout.sizes_text()``, as %dist_groups shows it;
    ``kept``: a kept session's name and keep time (``Session.kept_line``)."""
    gpus = [rs.gpu for rs in rows if rs.gpu is not None]
    threads = sorted({rs.threads for rs in rows if rs.threads})
    parts = [layout] if layout else []
    parts.append(backend)
    if gpus:
        parts.append(f"GPUs {','.join(dict.fromkeys(gpus))}")
    if threads:
        each = "/".join(map(str, threads))
        parts.append(f"{each} thread{'s' if threads != [1] else ''} per rank")
    shared = _shared_gpus(rows)
    if shared:
        parts.append(shared)
    if kept:
        parts.append(kept)
    parts.append(how)
    return f"{_ranks(len(rows))} ready ({'; '.join(parts)})."
