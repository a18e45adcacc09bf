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
three stops of 0.31-0.37 s): ``Engines.stop_all`` is all of it. Signals cost little
(SIGKILL to the 16 engines by pid: 6-33 ms, psutil checking each start time); the rest was
waiting, one phase after another: ipyparallel's stop of the engine set (65-160 ms: each
launcher hears its engine's exit code from the template), the engines' exits
(``psutil.wait_procs``, 70-95 ms), then the template with the 16 nannies it forked, only
signalled now (95-120 ms: SIGTERM, SIGKILL, their exits), then the controller (85 ms).
Everything else (folders, store, watchdog) is under 5 ms. Now everything the template
forked (engines, nannies, spare engines) gets SIGKILL in one pass before ipyparallel's stop
(``WarmTemplate.kill_forked``; the template, alive, still reaps them and reports each exit
code), so their exits overlap: the set's stop 35-70 ms, the engines' wait ~10 ms, the
template 10 ms, the controller 75-80 ms (stops of 0.17-0.21 s). A single ``killpg`` would
not save more: the signals were never the cost, and each engine and nanny has a session of
its own (``new_session``, as ``Popen(start_new_session=True)``: a signal to the kernel's
group must not reach them). A session whose spare engines were forked (after it sat idle)
has 16 more engines and nannies to end; this benchmark stops at once.
Measured 2026-11-26, the stop at 16 ranks before (main) and after, back to back in one run
(best of 3; one import torch 0.89-0.96 s): 0.28 -> 0.24 s, then 0.35 -> 0.20 s. All sizes
with this change: 0.12 / 0.15 / 0.18 / 0.22 s at 2 / 4 / 8 / 16 ranks (import torch 0.92 s):
met (issue 43's 0.72 s was on a day one import torch took 2.96 s).
Each stop now starts from a template warmed as %load_ext does, so the session forks its
controller from it (bench_start.py): a stop then ends the controller after the template is
gone, and waiting for it took 1.5-2 s (PID 1 reaping the orphan) until the launcher took its
zombie for ended; now the controller is stopped before the template ends, which reaps it
(no zombie left for PID 1). With that: 0.11 / 0.17 s at 4 / 16 ranks (``--ranks 4 16
--repeats 3``), 0.15 s at 16 after the reorder.
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


def warm() -> None:
    """A template warmed as %load_ext does: the session adopts it, and forks its controller
    from it too (the everyday case)."""
    from infini_notebook.launch import launchers, prewarm, template_client

    prewarm.warm()
    warmed = prewarm.warm_template()
    path = launchers.template_socket(launchers.profile_dir(prewarm._warmed.workdir))
    template_client.wait_ready(warmed, path)


def stop_time(n: int) -> float:
    warm()
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
