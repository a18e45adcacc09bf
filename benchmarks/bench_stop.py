"""Stop and hard-restart time of a session, against a fresh start.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_stop.py [--ranks 2 4 8 16]
        [--restart-ranks 4] [--repeats 3]

1. stop: ``session.stop()`` at each rank count (CPU ranks), until every engine and the
   controller are gone; one ``import torch`` in a fresh interpreter, timed in the same run,
   says how fast the machine is (issue 43's 0.72 s was on a day it took 2.96 s).
2. hard restart: ``session.restart(hard=True)`` against ``infini_notebook.start`` of the same
   size, both until every rank is initialised.
Targets: stop <= 0.5 s at 16 ranks (issue 43; issue 14 asked 1 s); hard restart <= fresh
start.

Profile (16 ranks, 2026-11-26, this 2-core VM; py-spy of the kernel, then each step timed,
three stops of 0.31-0.37 s): ``Engines.stop_all`` is all of it. Signals cost nothing worth
counting (SIGKILL to the 16 engines by pid: 6-33 ms, psutil checking each start time);
the rest is waiting for processes to end, which the OS does at its own pace: the engines'
exits (``psutil.wait_procs``, 70-95 ms: 16 address spaces of torch torn down on 2 cores),
ipyparallel's stop of the engine set (65-160 ms: each launcher hears its engine's exit code
from the template), the template with the 16 nannies it forked (95-120 ms: SIGTERM, then
SIGKILL, then their exits) and the controller (85 ms). Everything else (folders, store,
watchdog) is under 5 ms. "One signal per process group" would save the 6-33 ms of
signalling at most: each engine and nanny has a session of its own (``new_session``, as
``Popen(start_new_session=True)`` gives: a signal to the kernel's group must not reach them),
and the processes' own exits stay the floor. A session whose spare engines were forked
(after it sat idle) has 16 more engines and nannies to end; this benchmark stops at once.
Measured 2026-11-26 (best of 3, one run): stop 0.18 / 0.21 / 0.25 / 0.36 s at 2 / 4 / 8 / 16
ranks, one import torch 0.84 s: met at 16 (0.43x one import torch).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import infini_notebook


def import_torch() -> float:
    code = "import time; t = time.perf_counter(); import torch; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout)


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
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    imports = [import_torch()]
    stops = {n: min(stop_time(n) for _ in range(args.repeats)) for n in args.ranks}
    imports.append(import_torch())
    pairs = [restart_vs_fresh(args.restart_ranks) for _ in range(args.repeats)]
    hard, fresh = min(h for h, _ in pairs), min(f for _, f in pairs)
    print(f"\none import torch: {min(imports):.2f} s (before and after the stops: "
          f"{imports[0]:.2f}, {imports[1]:.2f} s)")  # fmt: skip
    print(f"stop, CPU ranks (best of {args.repeats}; target <= 0.5 s at 16):")
    print("  ranks   stop (s)")
    for n, t in stops.items():
        print(f"  {n:5d}   {t:8.2f}")
    print(f"hard restart vs fresh start, {args.restart_ranks} CPU ranks (best of {args.repeats}):")
    print(f"  fresh start:  {fresh:6.2f} s")
    print(f"  hard restart: {hard:6.2f} s   ratio {hard / fresh:.2f}  (target <= 1.0)")


if __name__ == "__main__":
    main()
