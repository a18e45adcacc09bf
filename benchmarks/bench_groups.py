"""Group creation: infini_notebook vs picotron's way, 8 gloo ranks on loopback, one run.

    .venv/bin/python benchmarks/bench_groups.py [--world 8] [--tp 2] [--pp 2] [--reps 5]

Every way runs in the same 8 processes, alternating which goes first in each repetition.
"calls/rank" counts new_group + split_group calls one rank makes (new_subgroups_by_enumeration
and init_device_mesh call new_group once per group of every kind, on every rank). "seconds" is
the median over repetitions of the slowest rank, between two barriers. Then the pure layout
for 65,536 ranks: time for every group of every kind (goal: under 1 s), and the time to
import the layout module alone, without torch or numpy (goal: under 0.2 s).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infini_notebook.groups import DEFAULT_KINDS, ParallelGroups, ParallelLayout  # noqa: E402

PICOTRON_KINDS = ("tp", "cp", "pp", "dp", "cp-dp", "pp-dp")
CALLS = {"n": 0}


def count_creation_calls() -> None:
    """Wrap new_group/split_group where both torch.distributed and c10d internals look them up."""
    import torch.distributed as dist
    from torch.distributed import device_mesh
    from torch.distributed import distributed_c10d as c10d

    for name in ("new_group", "split_group"):
        original = getattr(c10d, name)

        def counted(*args, _original=original, **kwargs):
            CALLS["n"] += 1
            return _original(*args, **kwargs)

        for module in (c10d, dist, device_mesh):  # device_mesh imported the names itself
            if hasattr(module, name):
                setattr(module, name, counted)


def picotron_way(layout: ParallelLayout) -> None:
    """picotron's ProcessGroupManager: one new_subgroups_by_enumeration per kind."""
    import torch
    import torch.distributed as dist

    tp, cp, pp, dp = layout.tp, layout.cp, layout.pp, layout.dp
    grid = torch.arange(layout.world_size).view(dp, pp, cp, tp)
    enum = dist.new_subgroups_by_enumeration
    enum([grid[d, p, c, :].tolist() for d in range(dp) for p in range(pp) for c in range(cp)])
    enum([grid[d, p, :, t].tolist() for d in range(dp) for p in range(pp) for t in range(tp)])
    enum([grid[d, :, c, t].tolist() for d in range(dp) for c in range(cp) for t in range(tp)])
    enum([grid[:, p, c, t].tolist() for p in range(pp) for c in range(cp) for t in range(tp)])
    enum([grid[:, p, :, t].flatten().tolist() for p in range(pp) for t in range(tp)])
    enum([grid[:, :, c, t].flatten().tolist() for c in range(cp) for t in range(tp)])


def device_mesh_way(layout: ParallelLayout) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    names = layout.dims[::-1]
    init_device_mesh("cpu", tuple(layout.sizes[d] for d in names), mesh_dim_names=names)


def ways(layout: ParallelLayout) -> dict:
    return {
        "infini_notebook (9 kinds + mesh)": lambda: ParallelGroups.build(layout),
        "infini_notebook (picotron's 6 kinds + mesh)": lambda: ParallelGroups.build(
            layout, kinds=PICOTRON_KINDS
        ),
        "picotron new_subgroups_by_enumeration (6 kinds)": lambda: picotron_way(layout),
        "init_device_mesh (4 dims, no combinations)": lambda: device_mesh_way(layout),
    }


def measure(fn) -> tuple[int, float]:
    import torch
    import torch.distributed as dist

    dist.barrier()
    before, start = CALLS["n"], time.perf_counter()
    fn()
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return CALLS["n"] - before, float(elapsed)


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))  # fmt: skip
    count_creation_calls()
    layout = ParallelLayout(world, tp=args.tp, pp=args.pp, cp=args.cp)
    table = ways(layout)
    results: dict[str, list] = {name: [] for name in table}
    for rep in range(args.reps):
        names = list(table) if rep % 2 == 0 else list(table)[::-1]  # alternate who goes first
        for name in names:
            results[name].append(measure(table[name]))
    if rank == 0:
        queue.put((layout.describe(), results))
    dist.barrier()
    dist.destroy_process_group()


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def layout_import_time() -> float:
    """Seconds to import core/layout.py on its own, in a fresh interpreter."""
    import subprocess

    path = Path(__file__).resolve().parents[1] / "infini_notebook" / "core" / "layout.py"
    code = (
        "import importlib.util, sys, time\n"
        f"spec = importlib.util.spec_from_file_location('layout_alone', {str(path)!r})\n"
        "mod = importlib.util.module_from_spec(spec); sys.modules['layout_alone'] = mod\n"
        "t = time.perf_counter(); spec.loader.exec_module(mod); print(time.perf_counter() - t)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout)


def verdict(seconds: float, goal: float) -> str:
    return f"goal < {goal} s: {'met' if seconds < goal else 'MISSED'}"


def layout_time(world: int) -> tuple[str, float, int]:
    start = time.perf_counter()
    layout = ParallelLayout(world, tp=8, cp=2, pp=8)
    n = sum(len(layout.groups(kind)) for kind in layout.kinds())
    return layout.describe(), time.perf_counter() - start, n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_loopback_port()
    mp.start_processes(rank_main, args=(args.world, port, args, queue), nprocs=args.world,
                       start_method="spawn")  # fmt: skip
    described, results = queue.get()

    print(f"group creation, gloo, {described}, median of {args.reps} reps (slowest rank)")
    print(f"{'way':<50} {'calls/rank':>10} {'seconds':>9}")
    for name, rows in results.items():
        calls = {c for c, _ in rows}
        seconds = statistics.median(s for _, s in rows)
        print(f"{name:<50} {'/'.join(map(str, sorted(calls))):>10} {seconds:>9.4f}")

    described, seconds, n = layout_time(65536)
    print(f"\npure layout, {described}: every group of all 15 kinds ({n:,} groups) in "
          f"{seconds:.3f} s ({verdict(seconds, 1.0)})")  # fmt: skip
    imported = layout_import_time()
    print(f"importing the layout module alone: {imported:.3f} s ({verdict(imported, 0.2)})")
    big = ParallelLayout(65536, tp=8, cp=2, pp=8)
    picotron_calls = sum(65536 // big.kind_size(k) for k in PICOTRON_KINDS)
    print(
        f"at that size picotron's way would make {picotron_calls:,} new_group calls per rank; "
        f"ours makes one per distinct kind (<= {len(DEFAULT_KINDS)} + 1)"
    )


if __name__ == "__main__":
    main()
