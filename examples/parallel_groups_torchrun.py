"""The parallel groups of notebooks/02_parallel_groups.ipynb in a plain torchrun script.

    TP_SIZE=2 PP_SIZE=2 torchrun --standalone --nproc_per_node 8 \
        examples/parallel_groups_torchrun.py

torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; ``init_parallel_groups()`` reads
the layout from TP_SIZE, CP_SIZE, PP_SIZE, DP_SIZE and PARALLEL_ORDER. NCCL when the machine
has GPUs, gloo on CPU: nothing else changes.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from infini_notebook.groups import init_parallel_groups


def main() -> None:
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = init_parallel_groups()  # the same call the notebook's ranks made at %dist_start

    # the notebook's membership check: every rank gathers the global ranks of its groups
    seen = {}
    for kind in ("tp", "dp", "pp", "tp-pp"):
        members = [None] * groups.layout.kind_size(kind)
        dist.all_gather_object(members, rank, group=groups.get(kind))
        assert members == groups.ranks_in(kind), (kind, members)
        seen[kind] = members
    # the mesh is built from the same groups: its tp sub-mesh is the tp group
    assert groups.mesh["tp"].get_group() is groups.tp

    rows = [None] * dist.get_world_size()  # one report from rank 0, not interleaved lines
    dist.all_gather_object(rows, (rank, seen))
    if rank == 0:
        print(groups.layout.describe())
        print("mesh:", groups.mesh)
        for r, kinds in rows:
            print(f"rank {r}: " + "  ".join(f"{k} {m}" for k, m in kinds.items()))
    groups.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
