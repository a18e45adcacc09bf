"""Parallel groups wired into %dist_start: 8 CPU ranks, tp=2 pp=2 (issue 3)."""

from __future__ import annotations

import ast

from conftest import text_of, use_session

from infini_notebook.groups import ParallelLayout

LAYOUT = ParallelLayout(8, tp=2, pp=2)
SESSION = "--nprocs 8 --tp 2 --pp 2 --timeout 60"


def per_rank(out: str) -> dict[int, object]:
    """'[rank 3] {...}' lines -> {3: {...}}."""
    values = {}
    for line in out.splitlines():
        if line.startswith("[rank "):
            label, _, rest = line.partition("] ")
            values[int(label[6:])] = ast.literal_eval(rest)
    return values


def test_memberships_proven_by_collectives(kernel):
    use_session(kernel, SESSION)
    cell = kernel.run(
        "%%dist\n"
        "found = {}\n"
        "for kind in ['tp', 'pp', 'dp', 'tp-pp', 'cp-dp']:\n"
        "    g = groups.get(kind)\n"
        "    members = [None] * dist.get_world_size(g)\n"
        "    dist.all_gather_object(members, rank, group=g)\n"
        "    total = torch.tensor([rank])\n"
        "    dist.all_reduce(total, group=g)\n"
        "    found[kind] = (sorted(members), total.item())\n"
        "print(found)",
        timeout=180,
    )
    found = per_rank(text_of(cell, "stdout"))
    assert sorted(found) == list(range(8))
    for rank, kinds in found.items():
        for kind, (members, total) in kinds.items():
            expected = LAYOUT.group_of(rank, kind)
            assert members == expected, (rank, kind)
            assert total == sum(expected)
    # the worked example, seen from the ranks
    assert found[0]["tp"][0] == [0, 1] and found[0]["dp"][0] == [0, 2]
    assert found[0]["pp"][0] == [0, 4]


def test_mesh_names_the_dims(kernel):
    use_session(kernel, SESSION)
    out = text_of(kernel.run("%%dist --ranks 0\nprint(mesh.mesh_dim_names, mesh['tp'].size())"))
    assert "[rank 0] ('pp', 'dp', 'cp', 'tp') 2" in out


def test_where_selects_ranks_by_coordinates(kernel):
    use_session(kernel, SESSION)
    out = text_of(kernel.run("%%dist --where pp=0\nprint('stage0', rank)"))
    ranks = sorted(int(line.split()[-1]) for line in out.strip().splitlines())
    assert ranks == LAYOUT.ranks_where(pp=0) == [0, 1, 2, 3]
    out = text_of(kernel.run("%%dist --where tp=1,dp=0\nprint(rank)"))
    # lines stream in as ranks print them, so compare the set of ranks, not their order
    assert sorted(line.split()[-1] for line in out.strip().splitlines()) == ["1", "5"]
    bad = text_of(kernel.run("%%dist --where xx=0\n1", allow_error=True))
    assert "xx" in bad and "Traceback" not in bad
    kernel.run("%dist_stop")
