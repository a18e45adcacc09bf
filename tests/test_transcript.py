"""The cell's output rendered from each rank's part (core/transcript.py, pure): rank order,
identical warnings once, --collapse by place, clear_output and update_display per rank."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from infini_notebook.core.transcript import Item, Transcript

WARNING = "In[7]:2: FutureWarning: old api\n  warnings.warn('old api', FutureWarning)\n"


def shown(items: list[Item]) -> list[tuple]:
    return [(i.ranks, i.kind, i.payload) for i in items]


@given(st.permutations([(r, k) for r in range(3) for k in range(3)]))
def test_rank_order_does_not_depend_on_arrival_order(arrivals):
    t = Transcript([0, 1, 2])
    for rank, k in sorted(arrivals, key=lambda a: a[1]):  # each rank's own order kept
        t.add_text(rank, "stdout", f"line {k} of {rank}\n")
    assert [i.payload for i in t.render()] == [
        f"line {k} of {r}" for r in range(3) for k in range(3)
    ]


def test_an_identical_warning_is_one_block_for_its_ranks_at_the_first_ranks_place():
    t = Transcript([0, 1, 2])
    for r in (2, 0, 1):
        t.add_text(r, "stdout", f"before {r}\n")
        t.add_text(r, "stderr", WARNING)
    t.add_text(1, "stderr", "In[7]:3: UserWarning: only here\n")
    assert shown(t.render()) == [
        ((0,), "stdout", "before 0"),
        ((0, 1, 2), "stderr", "In[7]:2: FutureWarning: old api"),
        ((0, 1, 2), "stderr", "  warnings.warn('old api', FutureWarning)"),
        ((1,), "stdout", "before 1"),
        ((1,), "stderr", "In[7]:3: UserWarning: only here"),
        ((2,), "stdout", "before 2"),
    ]


def test_collapse_merges_identical_lines_by_place_and_keeps_the_rest_apart():
    t = Transcript([0, 1, 2, 3])
    for r in range(4):
        t.add_text(r, "stdout", f"step 4 gradients match: True\nloss {r}\n")
    assert shown(t.render(collapse=True)) == [
        ((0, 1, 2, 3), "stdout", "step 4 gradients match: True"),
    ] + [((r,), "stdout", f"loss {r}") for r in range(4)]


def test_clear_with_wait_empties_a_rank_at_its_next_output_only():
    t = Transcript([0, 1])
    t.add_text(0, "stdout", "frame 0\n")
    t.add_text(1, "stdout", "frame 0\n")
    t.clear(0, wait=True)
    assert not t.take_changed()  # nothing gone yet: Jupyter's wait=True
    t.add_text(0, "stdout", "frame 1\n")
    assert t.take_changed() and not t.take_changed()
    assert [i.payload for i in t.render()] == ["frame 1", "frame 0"]
    t.clear(1, wait=False)
    assert t.take_changed() and [i.payload for i in t.render()] == ["frame 1"]


def test_update_display_replaces_only_that_ranks_display_with_that_id():
    t = Transcript([0, 1])
    for r in (0, 1):
        t.add_rich(r, {"data": {"text/html": "v0"}, "transient": {"display_id": "d"}})
    t.update_display(1, {"data": {"text/html": "v1"}, "transient": {"display_id": "d"}})
    assert t.take_changed()
    assert [i.payload["data"]["text/html"] for i in t.render()] == ["v0", "v1"]
    t.update_display(0, {"data": {"text/html": "x"}, "transient": {"display_id": "other"}})
    assert not t.take_changed()


def reference_write(line, chunk: str) -> None:
    """The carriage-return rule one part at a time (what OpenLine.write does in one pass)."""
    for i, part in enumerate(chunk.split("\r")):
        if i:
            line.returned = line.live = True
        if part:
            line.text, line.returned = (part, False) if line.returned else (line.text + part, False)


@given(st.lists(st.text(alphabet="ab\r", max_size=8), max_size=6))
def test_an_open_line_applies_carriage_returns_as_one_part_at_a_time_would(chunks):
    from infini_notebook.core.output import OpenLine

    fast, slow = OpenLine(), OpenLine()
    for chunk in chunks:
        fast.write(chunk)
        reference_write(slow, chunk)
        assert (fast.text, fast.returned, fast.live) == (slow.text, slow.returned, slow.live)


def test_figures_of_several_ranks_come_together_in_rank_order_where_the_first_was():
    png = {"data": {"image/png": "AAAA", "text/plain": "<Figure>"}}
    t = Transcript([0, 1])
    for r in (1, 0):
        t.add_text(r, "stdout", f"before {r}\n")
        t.add_rich(r, png)
        t.add_text(r, "stdout", f"after {r}\n")
    got = shown(t.render(figures_together=True))
    assert got == [
        ((0,), "stdout", "before 0"),
        ((0, 1), "figures", [(0, png), (1, png)]),
        ((0,), "stdout", "after 0"),
        ((1,), "stdout", "before 1"),
        ((1,), "stdout", "after 1"),
    ]
    one = Transcript([0, 1])
    one.add_rich(1, png)  # a single rank's figure stays where it is
    assert shown(one.render(figures_together=True)) == [((1,), "rich", png)]


def test_a_rank_that_clears_its_output_counts_toward_the_cap_afresh():
    from infini_notebook.core.output import StreamLabeler

    labeler = StreamLabeler(max_lines=3)
    assert labeler.feed("stdout", {0: "a\nb\nc\nd\n", 1: "x\n"}).count("capped at 3") == 1
    labeler.reset(0)  # rank 0 called clear_output
    assert labeler.feed("stdout", {0: "e\n", 1: "y\n"}) == "[rank 0] e\n[rank 1] y\n"


def test_a_clear_drops_the_rank_s_unfinished_line_too():
    from infini_notebook.core.output import StreamLabeler

    labeler = StreamLabeler()
    assert labeler.complete(0, "stdout", "partial-before-clear") == ""
    labeler.reset(0)
    assert labeler.complete(0, "stdout", "new\n") == "new\n"


def test_collapse_keeps_a_warning_whole_and_in_order_when_one_rank_printed_more_first():
    """Issue 50: --collapse split one warning into two rank groups and its two lines apart
    (ranks whose outputs differ before it put it at different places)."""
    t = Transcript([0, 1, 2])
    t.add_text(0, "stdout", "only rank 0 says this\n")
    for r in range(3):
        t.add_text(r, "stdout", "before\n")
        t.add_text(r, "stderr", WARNING)
        t.add_text(r, "stdout", "after\n")
    assert shown(t.render(collapse=True)) == [
        ((0,), "stdout", "only rank 0 says this"),
        ((1, 2), "stdout", "before"),
        ((0,), "stdout", "before"),
        ((0, 1, 2), "stderr", "In[7]:2: FutureWarning: old api"),
        ((0, 1, 2), "stderr", "  warnings.warn('old api', FutureWarning)"),
        ((0, 1, 2), "stdout", "after"),  # rank 0 waited at the warning: in step again
    ]  # on every rank: before, the warning, after


def test_identical_late_lines_and_cpp_warnings_merge_across_ranks_without_their_times():
    """Issue 50: at 64 ranks, c10d's 'hostname ... cannot be retrieved' came as 64 late
    lines, one per rank; each rank's time differs in torch's C++ warning prefix."""
    t = Transcript(list(range(64)))
    for r in range(64):
        stamp = f"[W1106 10:23:{r % 60:02d}.{r:09d} socket.cpp:752]"
        t.add_text(r, "stderr", f"(late) {stamp} [c10d] The hostname of the client socket\n")
        t.add_text(r, "stdout", f"(late) thread done\nmine {r}\n")
        t.add_text(r, "stderr", f"{stamp} [c10d] again\n")
        t.add_text(r, "stderr", f"[E1106 10:23:{r % 60:02d}.{r:09d} socket.cpp:1028] timed out\n")
    for collapse in (False, True):
        items = shown(t.render(collapse=collapse))
        everyone = tuple(range(64))
        assert items[0] == (
            everyone,
            "stderr",
            "(late) [W1106 10:23:00.000000000 socket.cpp:752] [c10d] The hostname of the "
            "client socket",  # rank 0's own line
        )
        assert items[1] == (everyone, "stdout", "(late) thread done")
        mine = [i for i in items if i[2].startswith("mine")]
        assert mine == [((r,), "stdout", f"mine {r}") for r in range(64)]
        for said in ("again", "timed out"):
            lines = [i for i in items if i[2].endswith(said)]
            assert len(lines) == 1 and lines[0][0] == everyone, lines
    t.add_text(5, "stdout", "(late) only here\n")
    assert ((5,), "stdout", "(late) only here") in shown(t.render())


ENTRIES = st.lists(
    st.sampled_from(
        [
            ("stdout", "a\n"),
            ("stdout", "b\n"),
            ("stderr", WARNING),
            ("stdout", "(late) x\n"),
            ("stderr", "In[7]:5: UserWarning: other\n"),
        ]  # fmt: skip
    ),
    max_size=6,
)


@given(st.lists(ENTRIES, min_size=1, max_size=4))
def test_collapse_shows_every_rank_its_own_lines_once_each_in_its_own_order(outputs):
    """Oracle: the items that name a rank, read in order, are exactly what it wrote."""
    t = Transcript(list(range(len(outputs))))
    for r, entries in enumerate(outputs):
        for stream, text in entries:
            t.add_text(r, stream, text)
    items = t.render(collapse=True)
    for r, entries in enumerate(outputs):
        wrote = [(s, line) for s, text in entries for line in text.splitlines()]
        assert [(i.kind, i.payload) for i in items if r in i.ranks] == wrote


def test_tracebacks_shown_as_they_came_stand_for_the_identical_ones_that_came_later():
    from infini_notebook.core.output import merge_told

    tb = "Cell In[{}], line 5\nZeroDivisionError: division by zero"
    told = {2: tb.format(7), 1: tb.format(7), 3: "ValueError: x"}
    failed = {0: tb.format(5), 4: "KeyError: k"}  # rank 0 numbers its cells differently
    assert merge_told(told, failed) == {1: (0, 1, 2), 3: (3,)}
