"""Widgets and their fallbacks (issue 5): tiles, group colors, live state, benchmark figures."""

from __future__ import annotations

import base64
import re
import subprocess
import sys
import threading
import time

import pandas as pd
import pytest
from conftest import text_of

from infini_notebook import viz
from infini_notebook.core.state import RankState
from infini_notebook.groups import ParallelLayout

WIDGET = viz.WIDGET_MIME


# --------------------------------------------------------------------------- grid (pure)


@pytest.mark.parametrize(
    "kw, cols, rows, shape",
    [
        ({"world_size": 4, "tp": 2}, ("tp",), ("dp",), (2, 2)),
        ({"world_size": 64, "tp": 8, "pp": 2, "order": "tp-cp-pp-dp"}, ("tp",), ("pp", "dp"),
         (8, 8)),
        ({"world_size": 8, "tp": 2, "pp": 2}, ("tp", "dp"), ("pp",), (2, 4)),
        ({"world_size": 8}, ("dp",), (), (1, 8)),
        ({"world_size": 32}, ("dp",), (), (2, 16)),
        ({"world_size": 1}, (), (), (1, 1)),
    ],
)  # fmt: skip
def test_grid_shape_keeps_ranks_in_reading_order(kw, cols, rows, shape):
    layout = ParallelLayout(**kw)
    g = viz.grid_shape(layout)
    assert (g.col_dims, g.row_dims, (g.nrows, g.ncols)) == (cols, rows, shape)
    for r in range(layout.world_size):  # the tile at (row, col) is the rank with those coords
        row, col = g.cell(r)
        c = layout.coords(r)
        if g.row_dims:
            assert viz.row_label(layout, g, row) == ", ".join(
                f"{d} rank {c[d]}" for d in reversed(g.row_dims)
            )
        if g.row_dims or layout.world_size == g.ncols:
            assert viz.col_label(layout, g, col) == (
                ", ".join(f"{d} rank {c[d]}" for d in reversed(g.col_dims)) or "rank"
            )


def test_planning_layout_rows_dp_pp_columns_tp():
    """Issue 40 item 6: headers name positions within groups ('tp rank 0': the first rank of
    every tp group), so a column is not read as a tp group (a row is one)."""
    layout = ParallelLayout(64, tp=8, pp=2, order="tp-cp-pp-dp")
    text = viz.layout_text(layout, "tp")
    lines = text.splitlines()
    assert [h for h in lines[1].strip().split("  ") if h] == [f"tp rank {i}" for i in range(8)]
    assert lines[2].startswith("dp rank 0, pp rank 0") and lines[3].startswith("dp rank 0, pp r")
    assert lines[2].split()[6:8] == ["r0", "A"] and "r63" in lines[9]
    small = viz.layout_text(ParallelLayout(4, tp=2), "tp").splitlines()
    assert small[1:3] == ["           tp rank 0  tp rank 1", "dp rank 0  r0 A       r1 A"]


def test_tiles_colored_by_group_kind():
    layout = ParallelLayout(4, tp=2)
    by_tp = [t.color for t in viz.group_tiles(layout, "tp")]
    by_dp = [t.color for t in viz.group_tiles(layout, "dp")]
    assert by_tp[0] == by_tp[1] != by_tp[2] == by_tp[3]
    assert by_dp[0] == by_dp[2] != by_dp[1] == by_dp[3]
    many = ParallelLayout(64, tp=4)  # 16 tp groups: neighbours always differ
    colors = [t.color for t in viz.group_tiles(many, "tp")]
    assert len({colors[g * 4] for g in range(16)}) == 16


def test_selection_outlines_all_groups_of_the_rank():
    layout = ParallelLayout(8, tp=2, pp=2)
    tiles = viz.group_tiles(layout, "tp", selected=5)
    assert tiles[5].selected and tiles[4].in_selected_group  # tp group [4, 5]
    assert tiles[7].shared == ("dp",) and tiles[1].shared == ("pp",)
    assert tiles[0].dim and not tiles[1].dim
    text = viz.selection_text(layout, 5, "tp")
    assert "rank 5 (tp1 dp0 pp1)" in text
    assert "tp: [4,5]" in text and "dp: [5,7]" in text and "pp: [1,5]" in text


def test_groups_listed_as_compact_rank_ranges():
    layout = ParallelLayout(8, tp=2, dp=2, pp=2)  # a tp-pp group is two runs: 0-1 and 4-5
    assert "A=[0-1,4-5]  B=[2-3,6-7]" in viz.layout_text(layout, "tp-pp")
    assert "[0-1,4-5]" in viz.groups_legend(layout, "tp-pp", None)
    strided = ParallelLayout(32, tp=2)  # dp groups of 16 ranks, stride 2
    assert "[0,2,4,6,8,10,12,14,16,18,20,22,…]" in viz.layout_text(strided, "dp")
    world = viz.layout_text(layout, "world")  # the group of all ranks is named so
    assert "letters are world groups" in world and "world groups: A=[0-7]" in world
    assert "<b>world groups</b>" in viz.groups_legend(layout, "world", None)


def test_layout_and_status_render_without_widgets():
    """Showing a layout or a status table (nbconvert, a terminal) loads neither ipywidgets nor
    matplotlib: the pure renderers are a module of their own."""
    code = (
        "import sys\n"
        "from infini_notebook.viz import render, status_render\n"
        "from infini_notebook.groups import ParallelLayout\n"
        "from infini_notebook import viz\n"
        "ParallelLayout(4, tp=2)._repr_html_()\n"
        "viz.status_text([]), viz.layout_text(ParallelLayout(4, tp=2))\n"
        "print(sorted(m for m in ('ipywidgets', 'matplotlib') if m in sys.modules))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_byte_sizes_in_both_styles():
    """Memory reads ``310.0 MiB``; message sizes read as nccl-tests prints them (``4K``)."""
    assert viz.format_bytes(512) == "512 B" and viz.format_bytes(310 << 20) == "310.0 MiB"
    assert viz.format_bytes(80 << 30) == "80.0 GiB" and viz._bytes(3 << 9) == "1.5 KiB"
    assert viz.size_label(512) == "512" and viz.size_label(1 << 10) == "1K"
    assert viz.size_label(3 << 19) == "1.5M" and viz.size_label(4 << 30) == "4G"


def test_groups_spanning_hosts_are_marked():
    layout = ParallelLayout(16, tp=4, order="tp-cp-pp-dp")
    hosts = viz.hosts_by_block(16, 8)
    assert viz.spanning_groups(layout.groups("tp"), hosts) == set()
    assert viz.spanning_groups(layout.groups("dp"), hosts) == {0, 1, 2, 3}
    tiles = viz.group_tiles(layout, "dp", hosts)
    assert all(t.spans_hosts for t in tiles) and viz.SPANS_HOSTS in tiles[0].label
    assert "host1" in tiles[8].label
    assert "span hosts" in viz.layout_html(layout, "dp", hosts)
    assert viz.SPANS_HOSTS in viz.layout_text(layout, "dp", hosts)
    assert viz.SPANS_HOSTS not in viz.layout_text(layout, "tp", hosts)


def test_static_fallbacks_name_every_rank_with_coords():
    layout = ParallelLayout(8, tp=2, pp=2)
    page = viz.layout_html(layout, "dp")
    for r in range(8):
        coords = viz.coords_label(layout.coords(r), layout)
        tile = re.search(rf'data-rank="{r}"[^>]*>([^<]*)<', page).group(1)
        assert tile.startswith(f"rank {r}\n{coords}")
    bundle = viz.layout_mimebundle(layout)
    assert set(bundle) == {"text/html", "text/plain"}
    assert "colored by tp" in bundle["text/html"]
    assert '<th class="infini-grid-head">dp rank 0, tp rank 1</th>' in bundle["text/html"]
    # a tile unrelated to the selection: the theme's colors (readable in a dark theme too)
    selected = viz.layout_html(layout, "tp", selected=5)
    dim = re.search(r'<div class="infini-group-tile infini-dim" data-rank="0" style="([^"]*)"',
                    selected)  # fmt: skip
    assert dim and f"background:{viz.render.BG};color:{viz.render.FG}" in dim.group(1)
    assert "opacity" not in selected


# --------------------------------------------------------------------------- group grid widget


def test_parallel_layout_html_repr_is_the_grid():
    layout = ParallelLayout(8, tp=2, pp=2)
    assert layout._repr_html_() == viz.layout_html(layout)


def test_group_grid_widget_recolors_and_selects_on_click():
    layout = ParallelLayout(4, tp=2)
    grid = viz.GroupGrid(layout)
    assert grid.kind == "tp" and len(grid.tiles) == 4
    assert [t.style.button_color for t in grid.tiles] == [t.color for t in grid.tile_views()]
    assert grid.tiles[0].style.button_color == grid.tiles[1].style.button_color
    grid.color_by.value = "dp"
    colors = [t.style.button_color for t in grid.tiles]
    assert colors[0] == colors[2] != colors[1]
    assert "dp groups" in grid.legend.value
    grid.tiles[3].click()  # a user's click
    assert grid.selected == 3 and "rank 3 (tp1 dp1)" in grid.info.value
    assert grid.tiles[3].layout.border.startswith("3px solid")
    assert grid.tiles[1].layout.border.startswith("3px dashed")  # dp group [1, 3]
    assert "infini-dim" in grid.tiles[0]._dom_classes  # shares no group with rank 3
    assert "infini-dim" not in grid.tiles[2]._dom_classes  # tp group [2, 3]
    assert grid.tiles[0].layout.border == f"2px dashed {grid.tile_views()[0].color}"
    assert grid.tiles[3].description.startswith("rank 3\ntp1 dp1")
    grid.tiles[3].click()  # clicking again clears the selection
    assert grid.selected is None and "infini-dim" not in grid.tiles[0]._dom_classes
    bundle = grid._repr_mimebundle_()
    assert WIDGET in bundle and "infini-group-tile" in bundle["text/html"]
    assert "r3 B" in bundle["text/plain"]
    grid.close()


# --------------------------------------------------------------------------- rank status


def fake_state(rank: int, state: str = "idle", **kw) -> RankState:
    coords = {"tp": rank % 2, "cp": 0, "dp": rank // 2, "pp": 0}
    base = dict(pid=100 + rank, host="node0", device="cpu", device_name="cpu", coords=coords)
    return RankState(rank=rank, state=state, **{**base, **kw})


def test_status_text_keeps_every_column_under_its_header():
    """A long state ("died (exit -9)") or all four coords pushed the columns after them
    right of their headers in %dist_status's text."""
    layout = ParallelLayout(16, tp=2, cp=2, pp=2)
    coords = {"tp": 1, "cp": 1, "dp": 1, "pp": 1}
    rows = [fake_state(0, "died", exit_code=-9, coords=coords), fake_state(1, host="h" * 20)]
    summary, header, *lines = viz.status_text(rows, layout).splitlines()
    for line, rs in zip(lines, rows):
        for name, value in (("coords", viz.coords_label(rs.coords, layout)), ("host", rs.host)):
            assert line[header.index(name) :].startswith(value), (header, line)
        assert line[: header.index("pid") + 3].endswith(str(rs.pid)), (header, line)


def test_a_kept_sessions_ready_line_names_it_and_its_keep_time():
    from infini_notebook.viz.status_render import ready_text

    kept = "kept session 'train': waits 30m for a kernel once none drives it"
    line = ready_text("gloo", [fake_state(0)], "engines started", kept=kept)
    assert line == f"1 rank ready (gloo; {kept}; engines started)."


def test_status_tile_shows_gpu_memory_and_dead_exit_code():
    gpu = fake_state(1, "busy", device="cuda:0", device_name="NVIDIA H100", memory_used=3 << 30)
    tile = viz.status_tile_html(gpu, ParallelLayout(4, tp=2))
    assert "infini-state-busy" in tile and "NVIDIA H100<br>" in tile and "3.0 GiB used" in tile
    assert "rank 1" in tile and "tp1 dp0" in tile and "pid 101" in tile
    dead = viz.status_tile_html(fake_state(2, "died", exit_code=-9))
    assert "died (exit -9)" in dead and viz.STATE_COLORS["died"] in dead
    assert ">busy</span>" in viz.status_tile_html(gpu, busy_for=1.0)
    assert ">busy 1m05s</span>" in viz.status_tile_html(gpu, busy_for=65.2)
    states = [fake_state(r, s) for r, s in enumerate(["idle", "busy", "busy", "failed"])]
    assert viz.status_summary(states) == "4 ranks: 2 busy, 1 failed, 1 idle"
    stuck = [fake_state(r, s) for r, s in enumerate(["stuck", "busy", "died", "stuck"])]
    assert viz.status_summary(stuck) == "4 ranks: 1 busy, 2 stuck, 1 died"
    with_template = viz.status_summary(states, template_rss=300 * 2**20)
    assert with_template == "4 ranks: 2 busy, 1 failed, 1 idle · warm template RSS 300.0 MiB"
    with_spares = viz.status_summary(states, template_rss=300 * 2**20, spares=4)
    assert with_spares.endswith("300.0 MiB · 4 spare engines for the next hard restart")
    text = viz.status_text(states, ParallelLayout(4, tp=2))
    assert re.search(r"3\s+failed\s+tp1 dp1\s+node0\s+103\s+cpu", text)


def test_tiles_show_live_usage_gpu_memory_and_util_or_rss_and_cpu():
    gpu = fake_state(
        0,
        "busy",
        device="cuda:0",
        device_name="NVIDIA H100",
        memory_used=12 << 30,
        memory_total=80 << 30,
        gpu_util=87,
        rss=2 << 30,
        cpu_percent=100.0,
    )
    assert viz.usage_text(gpu) == "12.0 GiB of 80.0 GiB · util 87%"
    tile = viz.status_tile_html(gpu)
    assert "cuda:0 NVIDIA H100<br>" in tile and "12.0 GiB of 80.0 GiB · util 87%" in tile
    no_nvml = fake_state(0, device="cuda:0", memory_used=1 << 30, memory_total=80 << 30)
    assert viz.usage_text(no_nvml) == "1.0 GiB of 80.0 GiB"
    cpu = fake_state(1, "busy", rss=310 << 20, cpu_percent=98.4)
    assert viz.usage_text(cpu) == "RSS 310.0 MiB · CPU 98%"
    assert viz.device_text(cpu) == "cpu · RSS 310.0 MiB · CPU 98%"
    assert "RSS 310.0 MiB · CPU 98%" in viz.status_tile_html(cpu)
    assert re.search(r"1\s+busy\s+.*cpu · RSS 310.0 MiB · CPU 98%", viz.status_text([cpu]))
    assert viz.device_text(fake_state(2)) == "cpu"  # not reported yet: nothing made up
    for gone in ("died", "stopped"):  # the last numbers would be stale
        assert viz.usage_text(fake_state(3, gone, rss=1 << 30, cpu_percent=50.0)) == ""


def test_telemetry_snapshot_keeps_known_numbers_only():
    from infini_notebook.engine import bootstrap as engine

    raw = b'{"rss": 1024, "cpu_percent": 97.5, "gpu_util": true, "evil": 1, "memory_used": "x"}'
    assert engine.parse_telemetry(raw) == {"rss": 1024, "cpu_percent": 97.5}
    assert engine.parse_telemetry(b"not json") == {}
    assert engine.parse_telemetry(b"[1, 2]") == {}
    assert set(engine.TELEMETRY_FIELDS) <= set(RankState.__dataclass_fields__)


def test_status_widget_follows_a_running_cell(session4):
    widget = viz.StatusWidget(session4, interval=0.1)
    try:
        assert len(widget.tiles) == 4 and widget.states == ["idle"] * 4 and widget.live
        for r, tile in enumerate(widget.tiles):
            coords = viz.coords_label(session4.layout.coords(r), session4.layout)
            assert f"<b>rank {r}</b> &nbsp;{coords}" in tile.value
        run = threading.Thread(
            target=session4.run, args=("import time; time.sleep(3)",), kwargs={"echo": False}
        )
        run.start()
        seen = wait_for(lambda: widget.states == ["busy"] * 4, 5)
        assert seen, widget.states
        assert "infini-state-busy" in widget.tiles[0].value
        assert "4 ranks: 4 busy" in widget.summary.value
        run.join(30)
        assert wait_for(lambda: widget.states == ["idle"] * 4, 5), widget.states
    finally:
        widget.close()
    assert not widget.live
    assert not [t for t in threading.enumerate() if t.name == "infini-status"]


def test_status_shows_rss_and_cpu_rising_while_a_cell_runs(session4):
    def status(r):
        return session4.status()[r]

    assert wait_for(lambda: all(rs.rss for rs in session4.status()), 10), session4.status()
    before = status(0).rss
    widget = viz.StatusWidget(session4, interval=0.2)
    # rank 0 fills 200 MB and holds it; rank 1 spins in a busy loop; both for a while
    code = (
        "import time\nif rank == 0:\n    held_block = torch.ones(50_000_000)\n"
        "    time.sleep(8)\nelse:\n    t0 = time.time()\n    while time.time() - t0 < 8:\n"
        "        pass"
    )
    cell = threading.Thread(
        target=session4.run, args=(code,), kwargs={"ranks": [0, 1], "echo": False}
    )
    cell.start()
    try:
        grew = wait_for(lambda: status(0).rss - before > 150 << 20, 7)
        # a busy loop shows clearly more CPU than an idle rank (the machine may be loaded)
        spun = wait_for(lambda: status(1).cpu_percent >= max(15, status(2).cpu_percent + 10), 7)
        still_running = cell.is_alive()
        seen = [status(r) for r in (0, 1)]
        tiles = [widget.tiles[r].value for r in (0, 1)]
    finally:
        widget.close()
        cell.join(60)
        session4.run("held_block = None", ranks=[0], echo=False)
    assert grew and spun and still_running, seen
    assert [rs.state for rs in seen] == ["busy", "busy"]
    assert "RSS " in tiles[0] and "CPU " in tiles[1]


def test_session_value_shows_status_with_fallbacks(session4, monkeypatch):
    # both renders read one snapshot: a rank's CPU share moves between two reads
    snapshot = session4.status()
    monkeypatch.setattr(session4, "status", lambda: snapshot)
    bundle = viz.session_mimebundle(session4)  # no kernel here: static renders only
    assert WIDGET not in bundle
    assert bundle["text/plain"].startswith("<infini_notebook.Session running: 4 ranks")
    assert bundle["text/html"].count('class="infini-rank-tile') == 4
    for r in range(4):
        assert re.search(rf"\n\s+{r}\s+idle\s+tp{r % 2} dp{r // 2}", bundle["text/plain"])
    assert session4._repr_mimebundle_() == bundle


def test_a_newer_status_freezes_the_earlier_and_a_stop_freezes_the_last():
    """Issue 40 item 4: one live status per session, the latest; an earlier one keeps what
    it showed when the newer one appeared (scrolling back, a failure still reads as one),
    and the live one stops at the session's stop, showing it stopped and no template."""

    class FakeSession:  # just what StatusWidget reads
        world_size = 2
        layout = ParallelLayout(2, tp=2)
        running = True
        failed = False

        def status(self):
            states = (
                ["stopped"] * 2
                if not self.running
                else ["idle", "failed" if self.failed else "idle"]
            )
            return [fake_state(r, s, coords={"tp": r, "cp": 0, "dp": 0, "pp": 0})
                    for r, s in enumerate(states)]  # fmt: skip

        def template_rss(self):
            return 300 << 20 if self.running else None

        def session_line(self, states):
            return "stopped" if not self.running else ("ready" if not self.failed else "broken")

    session = FakeSession()
    first = viz.status_widget(session, interval=0.05)
    assert (
        first.live
        and first.title == "session ready · 2 ranks: 2 idle · warm template RSS 300.0 MiB"
    )
    session.failed = True
    assert wait_for(lambda: first.states == ["idle", "failed"], 2)
    second = viz.status_widget(session, interval=0.05)
    assert second is not first and second.live and not first.live
    shown = first.title
    assert re.fullmatch(r"session broken · 2 ranks: 1 failed, 1 idle · warm template RSS "
                        r"300\.0 MiB · as of \d\d:\d\d:\d\d", shown), shown  # fmt: skip
    session.failed = False
    assert wait_for(lambda: second.states == ["idle", "idle"], 2)
    time.sleep(0.2)
    assert first.states == ["idle", "failed"] and first.title == shown  # kept as it was
    assert "infini-state-failed" in first.tiles[1].value
    session.running = False
    assert wait_for(lambda: not second.live, 2)
    assert second.states == ["stopped", "stopped"]
    assert second.title.startswith("session stopped · 2 ranks: 2 stopped · as of ")
    assert "template" not in second.title
    viz.close_status_widgets()


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


# --------------------------------------------------------------------------- benchmarks


def bench_frame() -> pd.DataFrame:
    """Rows shaped like bench.run_bench's: two tp groups, one world group, two collectives."""
    rows = []
    for coll in ("all_reduce", "all_gather"):
        for size in (1024, 4096, 16384):
            for group, ranks, bw in (
                ("tp", [0, 1], 1.0),
                ("tp", [2, 3], 1.5),
                ("world", [0, 1, 2, 3], 0.5),
            ):  # noqa: E501
                busbw = bw * size / 16384
                rows.append(dict(collective=coll, group=group, ranks=ranks, group_size=len(ranks),
                                 size_bytes=size, count=size // 4, dtype="float32", time_us=10.0,
                                 algbw_gbps=busbw / 2, busbw_gbps=busbw))  # fmt: skip
    return pd.DataFrame(rows)


def test_plot_busbw_one_panel_per_collective_one_line_per_group():
    fig = viz.plot_busbw(bench_frame())
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["all_reduce", "all_gather"]
    tp, world = panels[0].get_lines()
    assert list(tp.get_ydata()) == pytest.approx([1.25 / 16, 1.25 / 4, 1.25])  # mean of groups
    assert list(world.get_xdata()) == [1024, 4096, 16384]
    assert panels[0].get_ylabel() == "busbw (GB/s)"


def test_busbw_figure_is_large_with_a_gridline_per_labeled_tick():
    """Issue 40 item 8: one collective fills a 7.5 in wide figure; gridlines only at the
    labeled ticks (no minor ones), at most 9 sizes labeled over a 4K:1G sweep, and
    bandwidths written as numbers (0.01, not 10^-2)."""
    rows = bench_frame()
    sweep = pd.concat([rows[rows.collective == "all_reduce"].assign(size_bytes=s)
                       for s in [2**k for k in range(12, 31)]])  # fmt: skip
    fig = viz.plot_busbw(sweep)
    assert tuple(fig.get_size_inches()) == (7.5, 4.6)
    ax = fig.axes[0]
    fig.canvas.draw()
    assert len(ax.xaxis.get_minorticklocs()) == 0 and len(ax.yaxis.get_minorticklocs()) == 0
    shown = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert 4 <= len(shown) <= 9, shown
    labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert labels and not any("10^" in t or "$" in t for t in labels), labels
    assert all(line.get_alpha() == 0.15 for line in ax.get_xgridlines()), "light gridlines"
    assert tuple(viz.plot_busbw(bench_frame()).get_size_inches()) == (11.6, 4.0)  # 2 panels
    narrow = viz.plot_busbw(rows.assign(busbw_gbps=rows.busbw_gbps * 0.01 + 0.02)).axes[0]
    low, high = narrow.get_ylim()
    labeled = [t for t in narrow.get_yticks() if low <= t <= high]
    assert len(labeled) >= 2, labeled  # a range within a decade still has labels


def test_bench_view_controls_redraw():
    view = viz.bench_view(bench_frame())
    assert view.collective.options == ("all_reduce", "all_gather")
    assert view.group.options == ("all", "tp", "world")
    assert len(view.figure.axes[0].get_lines()) == 2 and "<svg" in view.image.value
    view.group.value = "world"
    assert len(view.figure.axes[0].get_lines()) == 1
    view.metric.value = "algbw_gbps"
    assert view.figure.axes[0].get_ylabel() == "algbw (GB/s)"
    assert view.figure.axes[0].get_lines()[0].get_ydata()[-1] == pytest.approx(0.25)
    view.collective.value = "all_gather"
    assert view.figure.axes[0].get_title() == "all_gather"
    bundle = view._repr_mimebundle_()
    assert WIDGET in bundle and bundle["text/html"].startswith('<div class="infini-figure"><svg')
    assert "all_gather" in bundle["text/plain"] and "16K" in bundle["text/plain"]
    view.close()


def test_p2p_heatmap_masks_the_diagonal():
    m = pd.DataFrame([[float("nan"), 2.0], [1.0, float("nan")]])
    m.index.name, m.columns.name = "src", "dst"
    m.attrs["size_bytes"] = 1 << 20
    fig = viz.p2p_heatmap(m)
    ax = fig.axes[0]
    assert ax.get_xlabel() == "dst rank" and ax.get_title() == "send/recv bandwidth, 1MB"
    assert sorted(t.get_text() for t in ax.texts) == ["1", "2"]
    view = viz.bench_view(bench_frame(), p2p=m)
    figures = [c for c in view.children if isinstance(c, viz.widgets.HTML)]
    assert len(figures) == 2 and all("<svg" in f.value for f in figures)
    view.close()


def test_figures_follow_the_notebook_theme():
    """Issue 33, item 4: text, axes and the legend's box take the theme's colors (CSS
    variables, so a dark theme gets light text) on a transparent background; the PNG for
    viewers without HTML is a white card."""
    import io

    from matplotlib.image import imread

    fig = viz.plot_busbw(bench_frame())
    svg = viz.figure_svg(fig)
    assert svg.startswith("<svg ") and "<?xml" not in svg
    assert viz.bench_plots.FG_MARK not in svg and viz.bench_plots.BG_MARK not in svg
    assert f"fill: {viz.render.FG}" in svg  # the text
    assert f"stroke: {viz.render.FG}" in svg  # the axes
    assert f"fill: {viz.render.BG}" in svg  # the legend's box
    assert "#ffffff" not in svg.lower()  # no white card behind it
    assert svg == viz.figure_svg(viz.plot_busbw(bench_frame()))  # a re-run diffs clean
    bundle = viz.figure_bundle(fig)
    assert bundle["text/html"] == f'<div class="infini-figure">{svg}</div>'
    png = imread(io.BytesIO(base64.b64decode(bundle["image/png"])))
    assert png[0, 0].tolist() == [1.0, 1.0, 1.0, 1.0]  # opaque white corner


# --------------------------------------------------------------------------- in a real kernel


def test_groups_magic_plans_without_a_session(kernel):
    plan = "--world 64 --tp 8 --pp 2 --order tp-cp-pp-dp --ranks-per-host 8"
    cell = kernel.run(f"%dist_groups {plan}")
    data = cell.outputs[0]["data"]
    assert WIDGET in data and data["text/html"].count('class="infini-group-tile"') == 64
    assert data["text/plain"].splitlines()[2].startswith("dp rank 0, pp rank 0")
    cell = kernel.run("%dist_groups --world 16 --tp 4 --color-by dp --ranks-per-host 8")
    assert "span hosts" in cell.outputs[0]["data"]["text/html"]
    bad = kernel.run("%dist_groups --world 6 --tp 4", allow_error=True)
    assert "not divisible" in text_of(bad)
    bad = kernel.run("%dist_groups", allow_error=True)
    assert "%dist_groups --world" in text_of(bad)


def test_status_magic_and_session_value_show_the_widget(kernel):
    """%dist_status is HTML and text updated in place (no widget: its output must show the
    last state once the kernel is gone); a session as a cell's value is a live widget."""
    kernel.run("%dist_start --nprocs 2 --tp 2 --timeout 30", timeout=180)
    for source, widget in (("%dist_status", False), ("dist_session", True)):
        cell = kernel.run(source)
        data = cell.outputs[-1]["data"]
        assert (WIDGET in data) == widget, source
        assert data["text/html"].count('class="infini-rank-tile') == 2
        assert re.search(r"1\s+idle\s+tp1", data["text/plain"])
    kernel.run(
        "from infini_notebook.viz import status\nlive = status._status_widgets[dist_session]"
    )
    assert "warm template RSS" in text_of(kernel.run("print(live.title)"))
    shown = kernel.run("%dist_status\nshown = status._status_widgets[dist_session]")
    assert shown.outputs[-1]["data"]["text/plain"].startswith("session ready · 2 ranks")
    assert " · as of " in text_of(kernel.run("print(live.title)"))  # frozen by the newer one
    kernel.run("session = dist_session\n%dist_stop")
    title = text_of(kernel.run("shown._thread and shown._thread.join(5)\nprint(shown.title)"))
    assert title.startswith("session stopped · 2 ranks: 2 stopped · as of "), title
    assert "template" not in title and "spare" not in title, title  # they are gone
    # its display was updated in place to the stopped state, what a saved notebook keeps
    # (the browser's view: test_browser.py)
    said = text_of(kernel.run("print(shown._shown)"))
    assert f"'text/plain': '{title.strip()}" in said and "infini-state-stopped" in said, said
    assert WIDGET not in said


def test_state_badges_and_group_tiles_keep_text_readable_in_any_theme():
    """WCAG 4.5:1: badges carry white text, group tiles dark text (#111) on their pastel."""

    def luminance(color: str) -> float:
        rgb = [int(color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
        lin = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in rgb]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    def contrast(a: str, b: str) -> float:
        hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
        return (hi + 0.05) / (lo + 0.05)

    from infini_notebook.viz.render import PALETTE

    assert {s: round(contrast(c, "#ffffff"), 2) for s, c in viz.STATE_COLORS.items()
            if contrast(c, "#ffffff") < 4.5} == {}  # fmt: skip
    assert [c for c in PALETTE if contrast(c, "#111111") < 4.5] == []


def test_color_by_lists_only_kinds_made_of_dims_larger_than_one():
    from infini_notebook.viz.render import color_kinds

    assert color_kinds(ParallelLayout(4, tp=2)) == ["tp", "dp"]  # cp = pp = 1: 2, not 8
    assert "tp-pp" in color_kinds(ParallelLayout(16, tp=2, pp=2))


def test_text_tables_put_each_header_over_its_column():
    """%dist_sessions' plain text (issue 50): with values holding spaces, pandas' right-aligned
    text put "driver" over the end of "started". Text starts under its header, numbers end
    under theirs, whatever the widths."""
    columns = ["name", "ranks", "backend", "started", "driver", "memory"]
    rows = [
        ["train", 4, "gloo", "2026-11-26 10:45:01", "kernel pid 4242", "1.2 GiB"],
        ["a-long-name", 16, "nccl, GPUs 0,1,2,3", "2026-11-26 09:00:00", "detached, ends in 9m 58s",
         "12.2 GiB"],
    ]  # fmt: skip
    header, *lines = viz.text_table(rows, columns).splitlines()
    for row, line in zip(rows, lines):
        for name, value in zip(columns, row):
            if isinstance(value, int):
                end = header.index(name) + len(name)
                assert line[:end].endswith(f" {value}") and line[end : end + 2] == "  ", line
            else:
                assert line[header.index(name) :].startswith(value), (name, header, line)
