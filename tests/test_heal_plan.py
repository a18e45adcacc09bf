"""Who gives a name to whom in %dist_heal, and why nobody can (core/heal_plan.py), and the
RankBook's record of replaced and healed ranks: pure, no processes. The layout: 4 ranks,
tp 2 x dp 2 (tp fastest), so dp groups [0, 2] and [1, 3], tp groups [0, 1] and [2, 3]."""

from __future__ import annotations

import pytest

from infini_notebook.core.heal_plan import check_names, plan, size_text
from infini_notebook.core.layout import ParallelLayout
from infini_notebook.core.rankbook import RankBook

LAYOUT = ParallelLayout(4, tp=2)
DP, TP = LAYOUT.groups("dp"), LAYOUT.groups("tp")
COORDS = {r: LAYOUT.coords(r) for r in range(4)}
MISSING = {"missing": "NameError: name 'model' is not defined"}


def linear(shape=(3, 4)) -> dict:
    sig = {"weight": [list(shape), "float32", "cpu"], "bias": [[shape[0]], "float32", "cpu"]}
    return {"kind": "module", "type": "Linear", "sig": sig, "dtensors": [], "fsdp": []}


def dtensor(rank: int, mesh: str, placement: str, dims=None) -> dict:
    """A DTensor on the session mesh's 1-D slice ``mesh`` (tp or dp) as rank ``rank``
    holds it."""
    group = LAYOUT.group_of(rank, mesh)
    leaf = {
        "leaf": "",
        "dims": [mesh] if dims is None else dims,
        "mesh": group,
        "placements": [placement],
        "sharded": [] if placement == "Replicate()" else [0],
        "coord": [group.index(rank)],
        "session_mesh": dims is None,
    }
    sig = {"": [[2, 4] if placement != "Replicate()" else [4, 4], "float32", "cpu"]}
    return {"kind": "tensor", "type": "DTensor", "sig": sig, "dtensors": [leaf]}


def run(found, groups=DP, kind="dp", stale=(), to=None, name="model"):
    return plan(name, found, groups, kind, set(stale), to, COORDS)


def test_a_missing_or_replaced_rank_receives_from_the_lowest_healthy_rank_of_its_group():
    found = {0: linear(), 1: linear(), 2: MISSING, 3: linear()}
    healed = run(found)
    assert healed.refused is None
    [t] = healed.transfers
    assert (t.group, t.src, t.dst, t.rebuild) == ([0, 2], 0, [2], True)
    # held but replaced since its last heal: overwritten in place
    [t] = run({r: linear() for r in range(4)}, stale={3}).transfers
    assert (t.group, t.src, t.dst, t.rebuild) == ([1, 3], 1, [3], False)
    # --to: exactly those ranks, the source the lowest other holder
    [t] = run({r: linear() for r in range(4)}, to={0}).transfers
    assert (t.src, t.dst) == (2, [0])
    assert t.part_for(1) is None and t.part_for(0)["src"] == 2


def test_nothing_to_heal_and_no_healthy_copy_are_said_in_one_line():
    nothing = run({r: linear() for r in range(4)})
    assert not nothing.transfers and "nothing to heal over dp" in nothing.refused
    none_left = run({0: linear(), 1: linear(), 2: MISSING, 3: linear()}, stale={0})
    assert none_left.refused == (
        "model has no healthy copy in dp group ranks 0,2 (each rank there lacks it or "
        "receives it): no replica to heal from; load it from a checkpoint"
    )
    nowhere = run({r: MISSING for r in range(4)})
    assert nowhere.refused.startswith("model is on no rank (NameError")


def test_shards_are_refused_with_the_way_on():
    # parameters whose shapes differ within the group (a hand-made tp shard)
    found = {0: linear((3, 4)), 1: linear((3, 2)), 2: MISSING, 3: linear((3, 2))}
    refused = run(found, groups=TP, kind="tp", to={1}).refused
    assert refused == (
        "model is sharded over tp (weight: shape [3, 4] on rank 0, [3, 2] on rank 1): "
        "no replica to heal from; load it from a checkpoint"
    )
    # a DTensor sharded over tp: rank 2 (missing) would hold the other part than rank 3
    found = {r: dtensor(r, "tp", "Shard(dim=0)") for r in range(4)} | {2: MISSING}
    refused = run(found, groups=TP, kind="tp", name="w").refused
    assert refused == (
        "w is sharded over tp (Shard(dim=0) on mesh dim tp): no replica to heal from; "
        "load it from a checkpoint"
    )
    # ... while over dp rank 0 holds the same part (tp coordinate 0): healed, made anew
    [t] = run(found, name="w").transfers
    assert (t.src, t.dst, t.rebuild) == (0, [2], True)
    # FSDP (torch's first) shards over ranks 0-3
    fsdp = {r: dict(linear(), fsdp=[0, 1, 2, 3]) for r in range(4)}
    assert "FSDP shards it over ranks 0-3" in run(fsdp, stale={2}).refused


def test_what_cannot_be_made_on_the_receiver_is_named():
    adam = {"kind": "optimizer", "type": "Adam", "groups": [2]}
    refused = run({0: adam, 1: adam, 2: MISSING, 3: adam}, name="opt").refused
    assert refused == (
        "opt is missing on rank 2: create the optimizer there first (as on rank 0, over the "
        "healed model's parameters), then %dist_heal opt"
    )
    other = run({0: adam, 1: adam, 2: dict(adam, groups=[1, 1]), 3: adam}, stale={2}, name="opt")
    assert "other parameter groups than on rank 0 ([1, 1] parameters against [2])" in (
        other.refused
    )
    # a DTensor on a mesh of the user's own, missing on the receiver
    own = {r: dtensor(r, "dp", "Replicate()", dims=["x"]) for r in range(4)} | {2: MISSING}
    assert "a DTensor on a mesh of your own" in run(own, name="d").refused
    ddp = {r: dict(linear(), ddp=True) for r in range(4)} | {2: MISSING}
    assert "is wrapped in DDP: build it there first" in run(ddp).refused


def test_the_line_says_what_moved_from_whom_to_whom():
    healed = run({0: linear(), 1: linear(), 2: linear(), 3: MISSING}, stale={2})
    healed.nbytes, healed.seconds = 120_000_000, 0.1
    assert healed.line == (
        "healed model (Linear) over dp from rank 0 to rank 2 and from rank 1 to rank 3: "
        "120.0 MB in 100.0 ms (600.0 MB/s per group); rebuilt on rank 3 from the pickled module"
    )
    assert [size_text(n) for n in (812, 4200, 1.5e9)] == ["812 B", "4.2 kB", "1.5 GB"]
    assert check_names("model  opt model") == ["model", "opt"]
    for bad in ("a[0]", "x + 1", ""):
        with pytest.raises(ValueError):
            check_names([bad])


def test_a_rank_is_stale_for_a_name_until_that_name_is_healed_into_it():
    book = RankBook()
    book.replaced([2], now=100.0)
    assert book.replaced_at() == {2: 100.0}
    assert book.stale("model") == {2}
    book.healed("model", [2], now=101.0)
    assert book.stale("model") == set() and book.stale("opt") == {2}
    book.replaced([2], now=102.0)  # replaced again: stale again
    assert book.stale("model") == {2}
