"""How long replacing one rank takes, from the kill to its first collective (issue 51).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_replace.py [--ranks 8] [--repeats 5]

A session of ``--ranks`` CPU ranks (gloo). Each repeat SIGKILLs one rank's engine (a
different rank each time), waits until the session sees it dead, then times
``session.restart(ranks=[r])`` (a new engine forked by the warm template, every rank's
groups made anew, the others keeping their variables) and the first all_reduce after it.
Target: replace to first collective <= 1 s on CPU. Prints each repeat and the median.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time

import infini_notebook


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    session = infini_notebook.start(nprocs=args.ranks, timeout=60)
    times = []
    try:
        session.run("kept = rank", echo=False)
        for i in range(args.repeats):
            victim = (i * 3 + 1) % args.ranks
            os.kill(session.status()[victim].pid, signal.SIGKILL)  # a rank this script started
            while session.status()[victim].state != "died":
                time.sleep(0.01)
            t0 = time.perf_counter()
            session.restart(ranks=[victim])
            replaced = time.perf_counter() - t0
            session.run("y = torch.ones(1); dist.all_reduce(y)", echo=False)
            total = time.perf_counter() - t0
            times.append(total)
            print(f"rank {victim}: replaced in {replaced:.2f} s, first all_reduce done at "
                  f"{total:.2f} s", flush=True)  # fmt: skip
        victims = {(i * 3 + 1) % args.ranks for i in range(args.repeats)}
        kept = session.run("print('kept' in globals())", echo=False).stdout
        assert all((v.strip() == "True") == (r not in victims) for r, v in kept.items()), kept
    finally:
        session.stop()
    median = statistics.median(times)
    print(f"{args.ranks} ranks, median of {len(times)}: {median:.2f} s from the replace to the "
          f"first collective (target <= 1 s: {'met' if median <= 1 else 'MISSED'})")  # fmt: skip


if __name__ == "__main__":
    main()
