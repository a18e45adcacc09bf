"""Stop and hard-restart time of a session, against a fresh start.

    .venv/bin/python benchmarks/bench_stop.py [--ranks 2 4 8 16] [--restart-ranks 4]

1. stop: ``session.stop()`` at each rank count (CPU ranks), until every engine and the
   controller are gone.
2. hard restart: ``session.restart(hard=True)`` against ``infini_notebook.start`` of the same
   size, both until every rank is initialised.
Targets (issue 14): stop <= 1 s at 16 ranks; hard restart <= fresh start.
"""

from __future__ import annotations

import argparse
import time

import infini_notebook


def stop_time(n: int) -> float:
    session = infini_notebook.start(nprocs=n)
    t0 = time.perf_counter()
    session.stop()
    return time.perf_counter() - t0


def restart_vs_fresh(n: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    session = infini_notebook.start(nprocs=n)
    fresh = time.perf_counter() - t0
    t0 = time.perf_counter()
    session.restart(hard=True)
    hard = time.perf_counter() - t0
    session.stop()
    return hard, fresh


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--restart-ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    stops = {n: min(stop_time(n) for _ in range(args.repeats)) for n in args.ranks}
    pairs = [restart_vs_fresh(args.restart_ranks) for _ in range(args.repeats)]
    hard, fresh = min(h for h, _ in pairs), min(f for _, f in pairs)
    print(f"\nstop, CPU ranks (best of {args.repeats}; target <= 1.0 s at 16):")
    print("  ranks   stop (s)")
    for n, t in stops.items():
        print(f"  {n:5d}   {t:8.2f}")
    print(f"hard restart vs fresh start, {args.restart_ranks} CPU ranks (best of {args.repeats}):")
    print(f"  fresh start:  {fresh:6.2f} s")
    print(f"  hard restart: {hard:6.2f} s   ratio {hard / fresh:.2f}  (target <= 1.0)")


if __name__ == "__main__":
    main()
