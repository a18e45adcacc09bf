"""Who waits for whom (waits.py, pure): which waits can never finish and how it is said."""

from __future__ import annotations

from infini_notebook import waits

WORLD = [0, 1, 2, 3]


def coll(op, ranks=WORLD, group="world", seq=7, line=4):
    return {"op": op, "group": group, "ranks": ranks, "peer": None, "seq": seq,
            "line": line, "in_cell": True, "func": "<module>"}  # fmt: skip


def test_a_collective_with_a_gone_member_is_hopeless_a_group_without_one_is_not():
    found = {1: coll("all_reduce"), 2: coll("all_reduce", [2, 3], "tp"), 3: None}
    assert waits.hopeless(found, {0: "failed"}) == {1: [0]}


def test_point_to_point_waits_only_for_its_peer():
    recv = {"op": "recv", "group": "world", "ranks": WORLD, "peer": 1, "seq": None}
    assert waits.hopeless({2: recv}, {0: "failed"}) == {}
    assert waits.hopeless({2: recv}, {1: "died"}) == {2: [1]}


def test_released_text_merges_ranks_that_wait_alike():
    found = {r: coll("all_reduce") for r in (1, 2, 3)}
    text = waits.released_text({1: [0], 2: [0], 3: [0]}, found, {0: "failed"}, "In[5]")
    assert text == (
        "ranks 1-3 were waiting for rank 0 in all_reduce #7 on the world group "
        "(In[5], line 4): released"
    )


def test_verdict_names_a_mismatch_and_ranks_not_in_the_collective():
    found = {0: coll("all_reduce"), 1: coll("all_reduce"), 2: coll("broadcast"), 3: None}
    text = waits.verdict(found)
    assert text.startswith("ranks 0-1 in all_reduce #7 on the world group (line 4 of the cell)")
    assert "rank 3 computing (not in a collective)" in text
    assert "mismatch in the world group [0, 1, 2, 3]" in text and "rank 3 of the world" in text


def test_matching_waits_are_no_mismatch():
    found = {0: coll("all_reduce", [0, 1], "tp"), 1: coll("all_reduce", [0, 1], "tp")}
    assert waits.mismatches(found) == []
    assert waits.verdict(found) == "ranks 0-1 in all_reduce #7 on the tp group (line 4 of the cell)"
