"""Run under torchrun (gloo): build the groups from env and prove every membership.

Each check is a collective whose result depends on who is in the group, so a wrong
group fails loudly instead of passing by coincidence. Prints one ``OK rank N ...`` line.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

from infini_notebook.groups import ParallelLayout, group_timeout, init_parallel_groups

INIT_TIMEOUT = timedelta(seconds=123)  # not torch's default: every group must inherit it


def check_group(pg: dist.ProcessGroup, members: list[int], rank: int, what: str) -> None:
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=pg)
    assert total.item() == sum(members), (what, total.item(), members)
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in members]
    dist.all_gather(gathered, torch.tensor([rank]), group=pg)
    assert [int(t) for t in gathered] == members, (what, gathered, members)
    assert dist.get_process_group_ranks(pg) == members, (what, members)


def main() -> None:
    dist.init_process_group("gloo", timeout=INIT_TIMEOUT)
    rank = dist.get_rank()
    if os.environ.get("ASYMMETRIC"):  # a user group before ours: only 0 and 1 register it
        dist.new_group([0, 1])
    groups = init_parallel_groups()  # layout from WORLD_SIZE, TP_SIZE, PP_SIZE, ...
    layout = groups.layout
    assert layout == ParallelLayout.from_env(), layout
    assert groups is init_parallel_groups(), "second call must return the memoized object"
    calls_at_init = groups.creation_calls
    # member-only creation needs the same group count on every rank; else every rank
    # enters every group's creation (torch's rule), which is slower but cannot hang
    expected = "new_group x" if os.environ.get("ASYMMETRIC") else "new_group (members only)"
    assert groups.how["tp"].startswith(expected), groups.how

    for kind in layout.kinds():  # every rank, same order: kinds not built yet are collective
        check_group(groups.get(kind), layout.group_of(rank, kind), rank, kind)
    for dim in ("tp", "cp", "dp", "pp"):
        assert getattr(groups, dim) is groups.get(dim)
        assert getattr(groups, f"{dim}_rank") == layout.group_of(rank, dim).index(rank)
    check_group(groups.world, list(range(layout.world_size)), rank, "world")
    if layout.zero1:
        check_group(groups.zero1, layout.zero1_group_of(rank), rank, "zero1")

    # the mesh: names are the layout's dims (slowest first), sub-meshes reuse our groups
    mesh = groups.mesh
    assert mesh.mesh_dim_names == layout.dims[::-1], mesh.mesh_dim_names
    for dim in ("tp", "cp", "dp", "pp"):
        assert mesh[dim].mesh.tolist() == layout.group_of(rank, dim), dim
        assert mesh[dim].get_group() is groups.get(dim), dim
        assert mesh.get_local_rank(dim) == layout.coords(rank)[dim], dim
    full = torch.arange(4 * layout.tp, dtype=torch.float32)
    dt = distribute_tensor(full, mesh["tp"], [Shard(0)])
    assert dt.to_local().tolist() == full.chunk(layout.tp)[groups.tp_rank].tolist()
    assert torch.equal(dt.full_tensor(), full)

    # pipeline neighbours: each stage sends its rank forward
    if groups.pp_next is not None:
        dist.send(torch.tensor([rank]), groups.pp_next)
    if groups.pp_prev is not None:
        got = torch.zeros(1, dtype=torch.int64)
        dist.recv(got, groups.pp_prev)
        assert int(got) == groups.pp_prev
    # cp ring: one step of ring attention's pass-the-block
    if layout.cp > 1:
        got = torch.zeros(1, dtype=torch.int64)
        ops = [
            dist.P2POp(dist.isend, torch.tensor([rank]), groups.cp_send_to),
            dist.P2POp(dist.irecv, got, groups.cp_recv_from),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        assert int(got) == groups.cp_recv_from

    # ad-hoc groups through the same registry: known rank sets are reused, not re-created
    before = groups.creation_calls
    assert groups.get_group(layout.group_of(rank, "tp")) is groups.tp
    assert groups.creation_calls == before
    odd = [r for r in range(layout.world_size) if r % 2]
    pg = groups.get_group(odd)
    if rank in odd:
        check_group(pg, odd, rank, "ad-hoc")
    else:
        assert pg is None

    built = {kind: groups.get(kind) for kind in layout.kinds()} | {"ad-hoc": pg}
    if layout.zero1:
        built["zero1"] = groups.zero1
    timeouts = {k: group_timeout(g).total_seconds() for k, g in built.items() if g is not None}

    dist.barrier()
    summary = {
        "calls_at_init": calls_at_init,
        "how": groups.how,
        "mesh": list(layout.dims[::-1]),
        "timeouts": timeouts,
    }
    print(f"OK rank {rank} {json.dumps(summary)}", flush=True)
    if rank == 0 and os.environ.get("SHOW_REPR"):
        print(repr(groups), flush=True)
    groups.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
