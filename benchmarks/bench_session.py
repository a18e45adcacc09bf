"""Start-to-first-collective and empty-cell latency, ours against doing it by hand.

    .venv/bin/python benchmarks/bench_session.py [--nprocs 4] [--cells 50]

1. start: ``infini_notebook.start(nprocs=N)`` + one all_reduce, against ``ipp.Cluster(n=N)``
   + ``init_process_group`` on every engine + one all_reduce (what a user writes by hand).
2. empty cell: ``%%dist`` against ipyparallel's ``%%px`` on the same engines, in one
   IPython shell, interleaved so that both see the same machine load.
Targets (issue 2): start no slower than by hand; empty cell within 1.2x of %%px.
"""

from __future__ import annotations

import argparse
import statistics
import time

import ipyparallel as ipp

ALL_REDUCE = "import torch; x = torch.ones(4); dist.all_reduce(x); assert x[0] == world_size"


def by_hand(n: int) -> float:
    t0 = time.perf_counter()
    cluster = ipp.Cluster(n=n, log_level=40)
    rc = cluster.start_and_connect_sync()
    rc.wait_for_engines(n, interactive=False)
    view = rc[:]
    view.scatter("rank", list(range(n)), flatten=True, block=True)
    view.execute(
        "import os, torch, torch.distributed as dist\n"
        f"os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='29533')\n"
        f"dist.init_process_group('gloo', rank=rank, world_size={n})\n"
        f"world_size = {n}\n" + ALL_REDUCE,
        block=True,
    )
    elapsed = time.perf_counter() - t0
    view.execute("dist.destroy_process_group()", block=True)
    rc.close()
    cluster.stop_cluster_sync()
    return elapsed


def ours(n: int) -> float:
    import infini_notebook

    t0 = time.perf_counter()
    session = infini_notebook.start(nprocs=n)
    session.run(ALL_REDUCE, echo=False)
    elapsed = time.perf_counter() - t0
    session.stop()
    return elapsed


def empty_cells(n: int, cells: int) -> tuple[float, float]:
    from IPython.testing.globalipapp import start_ipython

    import infini_notebook

    shell = start_ipython()
    shell.run_line_magic("load_ext", "infini_notebook")
    session = infini_notebook.start(nprocs=n)
    view = session.engines.client.view(slice(None))
    view.block = True  # %%px waits for the engines, as %%dist does
    view.activate()  # registers %%px on the very same engines
    px, dist = [], []
    for _ in range(cells):
        t = time.perf_counter()
        shell.run_cell_magic("px", "", "pass")
        px.append(time.perf_counter() - t)
        t = time.perf_counter()
        shell.run_cell_magic("dist", "", "pass")
        dist.append(time.perf_counter() - t)
    session.stop()
    return statistics.median(dist), statistics.median(px)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=4)
    parser.add_argument("--cells", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    hand, mine = [], []
    for _ in range(args.repeats):  # alternate so neither side gets a warmer disk cache
        hand.append(by_hand(args.nprocs))
        mine.append(ours(args.nprocs))
    d, p = empty_cells(args.nprocs, args.cells)
    print(f"\nstart-to-first-collective, {args.nprocs} CPU ranks (best of {args.repeats}):")
    print(f"  by hand (ipp.Cluster + init_process_group): {min(hand):6.2f} s")
    print(
        f"  infini_notebook.start:                      {min(mine):6.2f} s"
        f"   ratio {min(mine) / min(hand):.2f}  (target <= 1.0)"
    )
    print(f"empty cell, median of {args.cells}:")
    print(f"  %%px:   {p * 1e3:6.1f} ms")
    print(f"  %%dist: {d * 1e3:6.1f} ms   ratio {d / p:.2f}  (target <= 1.2)")


if __name__ == "__main__":
    main()
