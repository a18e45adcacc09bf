"""Memory over many cells: kernel and engine RSS stay flat (issue 12, item 7).

    .venv/bin/python benchmarks/bench_memory.py [--nprocs 2] [--cells 10000] [--code pass]

Runs ``%%dist`` cells in one IPython shell (the kernel side) and samples the resident memory
of this process and of every engine. The first sample is taken after a warm-up (caches,
imports and zmq buffers fill once); the target is last within 5 % of first on both sides.
"""

from __future__ import annotations

import argparse
import time

import psutil

WARMUP_CELLS = 200


def rss_mb(procs: list[psutil.Process]) -> float:
    return sum(p.memory_info().rss for p in procs) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--cells", type=int, default=10_000)
    parser.add_argument("--code", default="pass", help="each cell's source (default: pass)")
    parser.add_argument("--samples", type=int, default=10, help="samples after the warm-up")
    args = parser.parse_args()
    args.code = args.code.replace("\\n", "\n")  # --code "x = 1\nx"

    from IPython.testing.globalipapp import start_ipython

    import infini_notebook

    shell = start_ipython()
    shell.run_line_magic("load_ext", "infini_notebook")
    session = infini_notebook.start(nprocs=args.nprocs)
    kernel = [psutil.Process()]
    engines = [psutil.Process(rs.pid) for rs in session.ranks]
    every = max(1, args.cells // args.samples)
    rows = []
    t0 = time.perf_counter()
    try:
        for i in range(WARMUP_CELLS + args.cells):
            shell.run_cell_magic("dist", "", args.code)
            done = i + 1 - WARMUP_CELLS
            if done >= 0 and done % every == 0:
                rows.append((done, rss_mb(kernel), rss_mb(engines)))
                print(
                    f"{done:7d} cells  kernel {rows[-1][1]:8.1f} MB  engines {rows[-1][2]:8.1f} MB"
                )
    finally:
        session.stop()
    (_, k0, e0), (n, k1, e1) = rows[0], rows[-1]
    print(
        f"\n{n} cells of {args.code!r} on {args.nprocs} ranks in {time.perf_counter() - t0:.0f} s"
    )
    for name, first, last in (("kernel", k0, k1), (f"engines ({args.nprocs})", e0, e1)):
        growth = (last - first) / first * 100
        verdict = "ok" if abs(growth) <= 5 else "over target"
        print(
            f"  {name:<12} first {first:8.1f} MB  last {last:8.1f} MB  {growth:+5.1f} %  {verdict}"
        )


if __name__ == "__main__":
    main()
