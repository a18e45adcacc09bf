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
