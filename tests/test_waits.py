"""Who waits for whom (waits.py, pure): which waits can never finish and how it is said."""

from __future__ import annotations

from infini_notebook.core import waits

WORLD = [0, 1, 2, 3]


def coll(op, ranks=WORLD, group="world", seq=7, line=4, nth=None):
    return {"op": op, "group": group, "ranks": ranks, "peer": None, "seq": seq, "nth": nth,
            "line": line, "in_cell": True, "func": "<module>"}  # fmt: skip


def test_a_collective_with_a_gone_member_is_hopeless_a_group_without_one_is_not():
    found = {1: coll("all_reduce"), 2: coll("all_reduce", [2, 3], "tp"), 3: None}
    assert waits.hopeless(found, {0: "failed"}) == {1: [0]}


def test_point_to_point_waits_only_for_its_peer():
    recv = {"op": "recv", "group": "world", "ranks": WORLD, "peer": 1, "seq": None}
    assert waits.hopeless({2: recv}, {0: "failed"}) == {}
    assert waits.hopeless({2: recv}, {1: "died"}) == {2: [1]}


def test_released_text_merges_ranks_that_wait_alike():
    found = {r: coll("all_reduce", nth=1) for r in (1, 2, 3)}
    text = waits.released_text({1: [0], 2: [0], 3: [0]}, found, {0: "failed"}, "In[5]")
    assert text == (  # numbered within the cell, the group's number beside it (issue 40.5)
        "ranks 1-3 were waiting for rank 0 in the cell's 1st all_reduce (#7 on the world "
        "group) at In[5], line 4: released"
    )


def test_a_wait_is_said_with_what_the_ranks_know_of_it():
    assert waits.where(coll("all_reduce", nth=2)) == (
        "the cell's 2nd all_reduce (#7 on the world group) at line 4 of the cell"
    )
    assert waits.where(coll("broadcast", group="tp"), "In[3]") == (
        "broadcast (#7 on the tp group) at In[3], line 4"  # the recorder dropped the cell's
    )
    assert waits.where(dict(coll("barrier", seq=None), in_cell=False, func="step")) == (
        "barrier on the world group in step(), line 4"
    )
    recv = {"op": "recv", "group": "world", "ranks": WORLD, "peer": 1, "seq": None, "line": 2,
            "in_cell": True}  # fmt: skip
    assert waits.where(recv, "In[9]") == "recv from rank 1 on the world group at In[9], line 2"
    assert [waits.ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 111)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "111th"
    ]  # fmt: skip


def test_released_text_names_a_rank_that_came_to_the_wait_after_the_release():
    found = {r: coll("all_reduce") for r in (1, 2)}
    text = waits.released_text({1: [0], 2: [0]}, found, {0: "failed"}, "In[5]", late=[3])
    assert text == (
        "ranks 1-2 were waiting for rank 0 in all_reduce (#7 on the world group) at In[5], "
        "line 4; rank 3 lost its connection to a rank that left: released"
    )


def test_verdict_names_a_mismatch_and_ranks_not_in_the_collective():
    found = {0: coll("all_reduce"), 1: coll("all_reduce"), 2: coll("broadcast"), 3: None}
    text = waits.verdict(found)
    assert text.startswith("ranks 0-1 in all_reduce (#7 on the world group) at line 4 of the cell")
    assert "rank 3 computing (not in a collective)" in text
    assert "mismatch in the world group [0, 1, 2, 3]" in text and "rank 3 of the world" in text


def test_matching_waits_are_no_mismatch():
    found = {0: coll("all_reduce", [0, 1], "tp"), 1: coll("all_reduce", [0, 1], "tp")}
    assert waits.mismatches(found) == []
    assert waits.verdict(found) == (
        "ranks 0-1 in all_reduce (#7 on the tp group) at line 4 of the cell"
    )


def test_links_between_finds_a_ranks_connections_to_the_given_ranks_only():
    a, b, c, store = (
        ["127.0.0.1", 5001],
        ["127.0.0.1", 5002],
        ["127.0.0.1", 5003],
        ["127.0.0.1", 29500],
    )
    ab, ba = ["127.0.0.1", 40001], ["127.0.0.1", 40002]  # rank 1 <-> rank 2, both ways
    links = {
        1: [[ab, b], [a, ba], [["127.0.0.1", 40003], c], [["127.0.0.1", 40004], store]],
        2: [[b, ab], [ba, a]],
        3: [[c, ["127.0.0.1", 40003]]],
    }
    assert waits.links_between(links, 1, {1, 2}) == [[ab, b], [a, ba]]  # not to 3, not the store
    assert waits.links_between(links, 1, {3}) == [[["127.0.0.1", 40003], c]]
    assert waits.links_between(links, 1, {0}) == []  # a rank that did not answer


def test_a_rank_told_to_close_links_shuts_down_those_and_no_others():
    """The answer to "close ATTEMPT LINKS" (rank_services), on real loopback connections:
    the named one ends (its peer reads end of file, as a gloo wait then raises), another
    stays open, naming one already closed is no error, and a question from before a soft
    restart closes nothing."""
    import json
    import socket

    from infini_notebook.engine import rank_services

    server = socket.create_server(("127.0.0.1", 0))
    pairs = []
    for _ in range(2):
        mine = socket.create_connection(server.getsockname())
        theirs, _ = server.accept()
        pairs.append((mine, theirs))
    (closing, peer), (kept, kept_peer) = pairs
    link = [list(closing.getsockname()), list(closing.getpeername())]
    rank_services.follow_attempt(3)  # as an engine is after two soft restarts
    try:
        stale = rank_services.answer(f"close 2 {json.dumps([link])}", None)
        assert stale == "stale"  # asked before the groups were rebuilt: left alone
        assert rank_services.answer(f"close 3 {json.dumps([link])}", None) == "1"
        peer.settimeout(5)
        assert peer.recv(1) == b""  # end of file: the connection was shut down
        kept.sendall(b"x")
        assert kept_peer.recv(1) == b"x"
        assert rank_services.answer(f"close 3 {json.dumps([link])}", None) in ("0", "1")
    finally:
        rank_services._attempt.clear()
        for sock in (server, *pairs[0], *pairs[1]):
            sock.close()


# ----- questions answered late, ranks given up (issue 30, items 5 and 7) ----------------------
def test_an_abort_or_close_meant_for_earlier_groups_is_answered_stale():
    from infini_notebook.engine import rank_services

    rank_services.follow_attempt(2)  # the groups were rebuilt twice since
    assert rank_services.answer("release 1", scratch=None) == "stale"
    assert rank_services.answer("abort 1", scratch=None) == "stale"
    assert rank_services.answer("close 1 []", scratch=None) == "stale"


def test_a_released_rank_out_of_its_wait_is_not_given_up_until_much_later():
    from infini_notebook.kernel.watch import RELEASE_GIVE_UP_S, CellWatch

    watch = CellWatch(s=None, cell=None)
    # rank 1 still waits, rank 2 left its wait (its traceback being formatted), rank 3 silent
    watch.found = {1: {"op": "all_reduce"}, 2: None}
    assert watch._stuck({1, 2, 3}, since=5.0) == {1, 3}
    assert watch._stuck({1, 2, 3}, since=RELEASE_GIVE_UP_S + 1) == {1, 2, 3}
