"""Push and pull of large tensors to local ranks, shared memory on and off, against pickling.

    .venv/bin/python benchmarks/bench_push_pull.py [--ranks 4] [--mb 100] [--repeats 5]

1. ``pickle.dumps`` of one float32 tensor of MB megabytes: the unit of the table.
2. push: ``session.push({"x": tensor})`` to every rank (CPU ranks, all on this host).
3. pull: ``session.pull("y")``, each rank holding its own tensor of MB megabytes; then the
   same followed by a read of every value (a value pulled through shared memory lies on a
   mapping whose pages are first touched then).
Each with shared memory (``shm_transport.enabled``) and without (ipyparallel's stream).
Target (issue 22): push and pull <= 3x the pickling time.
"""

from __future__ import annotations

import argparse
import gc
import pickle
import time

import torch

import infini_notebook
from infini_notebook.engine import shm_transport


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def pull_and_read(session) -> None:
    for value in session.pull("y").values():
        value.sum()


def measure(session, x: torch.Tensor, repeats: int) -> dict[str, float]:
    return {
        "push": best(lambda: session.push({"x": x}), repeats),
        "pull": best(lambda: session.pull("y"), repeats),
        "pull, then read": best(lambda: pull_and_read(session), repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--mb", type=int, default=100, help="size of each tensor (MB)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    numel = args.mb * 1_000_000 // 4
    x = torch.randn(numel)
    dumps = best(lambda: pickle.dumps(x), args.repeats)
    session = infini_notebook.start(nprocs=args.ranks)
    try:
        session.run(f"y = torch.randn({numel})", echo=False)
        results = {}
        for on in (True, False):
            shm_transport.enabled = on
            results[on] = measure(session, x, args.repeats)
    finally:
        shm_transport.enabled = True
        session.stop()
    print(f"\n{args.mb} MB float32 tensors, {args.ranks} CPU ranks (best of {args.repeats})")
    print(f"  pickle.dumps of one: {dumps:.3f} s (the unit of the ratios; target <= 3x)")
    print("  what              shm on (s)  ratio   shm off (s)  ratio")
    for what in results[True]:
        on, off = results[True][what], results[False][what]
        print(f"  {what:<16} {on:10.3f}  {on / dumps:5.1f}x  {off:11.3f}  {off / dumps:5.1f}x")


if __name__ == "__main__":
    main()
