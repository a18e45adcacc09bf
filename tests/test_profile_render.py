"""What %%dist_profile shows (issue 40, items 1 and 7), from synthetic traces with a known
straggler (kineto_synth.py): the verdict first, the figure's label on the straggler,
tables rounded under captions, the Perfetto address a link, lines wrapped between words.
The same on real ranks, against injected sleeps: tests/test_profile.py."""

from __future__ import annotations

import re

import pandas as pd
from test_timeline import gloo_straggler

from infini_notebook.core import timeline as tl
from infini_notebook.kernel.profile import ProfileResult
from infini_notebook.viz import profile_render

FOLDER = "dist_profile/In4-20261126-104501"


def result(coverage: str = "", partial=()) -> ProfileResult:
    traces = [gloo_straggler(r, 1e9 * r, 0.0).trace() for r in range(4)]
    tl.align(traces)
    ranks = pd.DataFrame(tl.rank_rows(traces))
    ranks.loc[3, "wait_ms"] = None  # as when nothing matched on rank 3's peers
    v = tl.verdict(traces)
    return ProfileResult(
        ranks=ranks,
        collectives=pd.DataFrame(tl.collective_rows(traces)),
        folder=FOLDER,
        merged=f"{FOLDER}/merged.json",
        files={r: f"{FOLDER}/rank{r}.json" for r in range(4)},
        partial=list(partial),
        size_bytes=48_000,
        coverage=coverage,
        verdict=v.text,
        straggler=(v.rank, v.last, v.of),
    )


def test_the_text_leads_with_the_verdict_and_rounds_the_tables_under_captions():
    text = result()._repr_mimebundle_()["text/plain"]
    lines = text.splitlines()
    assert lines[0] == (
        "rank 2 arrived last in 3 of 3 all_reduces; the other ranks waited 900 ms each "
        "(30 % of the cell)"
    )
    flat = " ".join(text.split())  # the captions are wrapped
    assert "Each rank's cell (ms): compute + communication + wait + idle = wall." in flat
    assert "top_ops: the ops that took its compute time (self time)" in flat
    assert "The 3 collectives that made the others wait most, of 3 in the cell (ms)." in flat
    numbers = re.findall(r"\b\d+\.\d+\b", text)
    assert numbers and all(len(n.split(".")[1]) == 1 for n in numbers), numbers
    assert "end_spread_ms" not in text and "seq" not in text
    row = next(line for line in lines if line.split()[:1] == ["3"] and "aten::mm" in line)
    assert row.split()[:6] == ["3", "3000.0", "150.0", "150.0", "1800.0", "3"], row  # no wait
    assert max(len(line) for line in lines if "aten::" not in line) <= 100


def test_the_html_leads_with_the_verdict_links_perfetto_and_captions_each_table():
    html = result()._repr_mimebundle_()["text/html"]
    assert html.startswith('<p class="infini-verdict"><b>rank 2 arrived last in 3 of 3')
    assert html.index("infini-verdict") < html.index("<svg") < html.index("<table")
    assert '<a href="https://ui.perfetto.dev"' in html
    assert f"in {FOLDER}/: merged.json opens in" in html
    captions = re.findall(r"<caption[^>]*>(.*?)</caption>", html)
    assert len(captions) == 2 and captions[0].startswith("Each rank"), captions
    cells = re.findall(r"<td>([\d.]+)</td>", html)
    assert "3000.0" in cells and all(len(c.split(".")[-1]) == 1 for c in cells if "." in c)


def test_the_figure_labels_the_rank_that_made_the_others_wait():
    svg = result()._repr_mimebundle_()["text/html"]
    assert "arrived last 3/3" in svg and "wait for the last peer" in svg


def test_a_long_summary_wraps_between_words_and_keeps_the_path_whole():
    long = "wait is measured for the ops matched on every member " * 4
    shown = result(coverage=long.strip(), partial=[1])
    text = shown.summary()
    assert all(len(line) <= 100 for line in text.splitlines()), text
    assert text.split() == shown.summary(wrapped=False).split()  # no word cut in two
    assert f"{FOLDER}/:" in text and "https://ui.perfetto.dev" in text
    assert profile_render.wrap("a " * 80 + "x" * 150).endswith("\n" + "x" * 150)


def test_the_tables_headers_stand_over_their_columns():
    """Text left under its header's start, numbers right under its end; the collectives'
    ranks are their members (the 4 synthetic ranks: "0-3"), not a count."""
    text = result()._repr_mimebundle_()["text/plain"]
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("n  collective"))
    header, rows = lines[head], lines[head + 1 : head + 4]
    for row in rows:
        assert row[header.index("ranks") :].startswith("0-3  "), (header, row)  # text: left
        end = header.index("at_ms") + len("at_ms")  # numbers: right, under the header's end
        assert row.rstrip().endswith(".0") and len(row.rstrip()) == end, (header, row)
    first = next(i for i, line in enumerate(lines) if line.startswith("rank  wall_ms"))
    header = lines[first]
    for row in lines[first + 1 : first + 5]:
        assert row.index("aten::mm") == header.index("top_ops"), (header, row)


def test_a_top_ops_item_is_never_broken_in_the_html():
    html = result()._repr_mimebundle_()["text/html"]
    cells = re.findall(r"<td>([^<]*aten::[^<]*)</td>", html)
    assert cells and all(c == "aten::mm\u00a0100\u00a0%" for c in cells), cells
    ranks = re.findall(r"<td>(\d+-\d+)</td>", html)
    assert ranks == ["0-3"] * 3, ranks  # the collectives' members
