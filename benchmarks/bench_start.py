"""Start, hard restart, push/pull and stop, as ratios to what they cannot beat, in one run.

    .venv/bin/python benchmarks/bench_start.py [--ranks 2 4 8 16] [--repeats 2] [--mb 100]

Floors, measured in this run: one ``import torch`` in a fresh interpreter (every rank needs
torch; best of 3 at the start and 3 at the end, as the machine's speed drifts), and one
``pickle.dumps`` of the pushed tensor. Rows (CPU ranks; the kernel has
imported torch already, as a notebook that made a tensor has):
1. start -> first collective (``infini_notebook.start`` + one all_reduce) at each size:
   engines forked from a template warmed beforehand (as ``%load_ext`` does, timed once it is
   ready), from the session's own template, and, with ``no_template=True``, started the usual
   way;
2. hard restart -> first collective at 4 ranks, both ways: with the template, right after the
   start (the worst case: the spare engines a session forks once idle are not there yet) and
   after a pause (a user's, here until the spares have registered: the usual case);
3. push of one tensor of ``--mb`` MB to 4 local ranks, pull of 4 such tensors;
4. stop at the largest size.
Targets (issue 22, for the template path): start <= 3x import at 16 ranks and <= 1.5x at 4;
hard restart <= 0.5x import; push and pull <= 3x pickling; stop <= 1 s at 16 ranks.
Issue 43's goals: start at 16 ranks <= 1.0x one import, hard restart (spares) <= 0.25x.

Measured 2026-11-26, before: start at 16 ranks (template warmed at %load_ext) 1.95 s =
1.86x one import (4 ranks 1.25x), hard restart with spares 0.32x, stop at 16 ranks 0.49 s.

Where a start's time went (/tmp scripts timing each step of ``Engines.start`` and the whole
machine's CPU, ``psutil.cpu_times``, around it; 4 / 16 ranks): the controller 0.52 s (0.48 s
of it a fresh interpreter importing ipyparallel's controller and starting its schedulers,
before it writes its connection files, which the engines need), the engines forked and
registered 0.19 / 0.57 s, the ranks' bootstrap (process groups) 0.08 / 0.23 s, the first
all_reduce 0.02 / 0.06 s. Changed: the controller is forked from the warm template when it
is ready (it has imported ipyparallel's controller; 0.52 -> 0.34 s); the kernel waits for
the controller's files with a 5 ms poll (ipyparallel's polls every 0.1 s) and for engines
by their registration (ipyparallel's callbacks; a 50 ms poll before).

After (``--ranks 4 16 --repeats 2``, one import torch 0.81 s): start at 16 ranks 1.33 s =
1.63x, at 4 ranks 0.65 s = 0.80x; hard restart with spares 0.20 s = 0.25x (goal met; single
runs 0.24-0.26 s, 0.29-0.32x); stop at 16 ranks 0.25 s.

The floor on this machine: a start at 16 ranks makes the machine do 2.0-2.2 s of CPU work
(sixteen engines registering and starting their kernels, sixteen bootstraps creating the
process groups, the controller), so on two cores it cannot take less than 1.0-1.1 s =
1.2-1.3x one import: the 1.0x goal is below it here, and we are at 1.3x of that floor
(the rest: steps that wait on one another, the controller before the engines, the engines
before the bootstrap). A hard restart with spares is CPU-bound already (the machine's CPU /
2 = its wall time: 0.51 s of CPU, 0.26 s), so what is left to gain there is CPU: 0.12-0.13 s
is the four bootstraps creating process groups on two cores, 0.09-0.12 s before it
(ending the old engines, taking the spares).
"""

from __future__ import annotations

import argparse
import pickle
import subprocess
import sys
import time

import torch

import infini_notebook
from infini_notebook.launch import launchers, prewarm, template_client

WARMED, TEMPLATE, NO_TEMPLATE = "template warmed at %load_ext", "template", "no template"
IMP = object()  # a row's floor is one import torch (known once the run ends)
ALL_REDUCE = "x = torch.ones(4); dist.all_reduce(x); assert x[0] == world_size"


def import_torch() -> float:
    code = "import time; t = time.perf_counter(); import torch; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout)


def pickling(tensor: torch.Tensor) -> float:
    t0 = time.perf_counter()
    pickle.dumps(tensor, protocol=5)
    return time.perf_counter() - t0


def start(n: int, how: str) -> tuple[float, infini_notebook.Session]:
    if how == WARMED:  # as %load_ext does; the user's typing then hides its imports
        prewarm.warm()
        warmed = prewarm.warm_template()
        template_client.wait_ready(warmed, launchers.template_socket(warmed_profile()))
    t0 = time.perf_counter()
    session = infini_notebook.start(nprocs=n, no_template=how == NO_TEMPLATE)
    session.run(ALL_REDUCE, echo=False)
    return time.perf_counter() - t0, session


def spares_ready(session) -> None:
    """Until the spare engines the session forks once idle (engine_sets.Standby) registered."""
    spare = session.engines.standby
    if spare is None:
        return
    spare.launch.result(timeout=120)
    while len(session.engines.client.ids() - spare.known) < session.world_size:
        time.sleep(0.01)


def warmed_profile() -> str:
    return launchers.profile_dir(prewarm._warmed.workdir)


def hard_restart(session) -> float:
    t0 = time.perf_counter()
    session.restart(hard=True)
    session.run(ALL_REDUCE, echo=False)
    return time.perf_counter() - t0


def push_pull(session, tensor: torch.Tensor) -> tuple[float, float]:
    t0 = time.perf_counter()
    session.push({"pushed": tensor})
    push = time.perf_counter() - t0
    session.run("pulled = pushed + rank", echo=False)
    t0 = time.perf_counter()
    session.pull("pulled")
    return push, time.perf_counter() - t0


def stop(session) -> float:
    t0 = time.perf_counter()
    session.stop()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--mb", type=int, default=100)
    args = parser.parse_args()
    imports = [import_torch() for _ in range(3)]
    tensor = torch.rand(args.mb * 2**20 // 4)
    pick = min(pickling(tensor) for _ in range(3))
    rows, stops = [], []
    for n in args.ranks:
        for how in (WARMED, TEMPLATE, NO_TEMPLATE):
            starts = []
            for repeat in range(args.repeats):
                took, session = start(n, how)
                starts.append(took)
                if n == 4 and repeat == 0 and how != WARMED:
                    rows += four_ranks(session, how, tensor, pick, args)
                if n == max(args.ranks) and how == TEMPLATE:
                    stops.append(stop(session))
                session.stop()
            goal = {16: 3.0, 4: 1.5}.get(n) if how != NO_TEMPLATE else None
            rows.append((f"start -> first collective, {n} ranks, {how}", min(starts), IMP, goal))
    rows.append((f"stop, {max(args.ranks)} ranks (template)", min(stops), None, None))
    at_end = [import_torch() for _ in range(3)]
    imp = min(imports + at_end)  # the lower floor: the larger, stricter ratio
    print(
        f"\none import torch: {imp:.2f} s (best of 3 at the start {min(imports):.2f} s, at the "
        f"end {min(at_end):.2f} s); pickling {args.mb} MB: {pick:.3f} s (best of 3; the rest "
        f"best of {args.repeats})"
    )
    print(f"{'figure':78s} {'s':>6s} {'ratio':>6s}  goal")
    for what, t, floor, goal in rows:
        floor = imp if floor is IMP else floor
        ratio = f"{t / floor:6.2f}" if floor else " " * 6
        g = f"<= {goal}x" if goal else ("<= 1 s" if what.startswith("stop") else "")
        print(f"{what:78s} {t:6.2f} {ratio}  {g}")


def four_ranks(session, how: str, tensor, pick: float, args) -> list:
    """Hard restarts and push/pull at 4 ranks, as rows."""
    at_once = hard_restart(session)  # within a second of the start: no spare engines yet
    after_pause = []
    for _ in range(args.repeats):
        spares_ready(session)  # a user's pause
        after_pause.append(hard_restart(session))
    push, pull = push_pull(session, tensor)  # right after a hard restart and a cell
    template = how != NO_TEMPLATE
    goal = 0.5 if template else None
    rows = [("hard restart -> first collective, 4 ranks, " + how, min(after_pause), IMP, goal)]
    if template:
        rows[0] = (rows[0][0] + ", after a pause (spares)", *rows[0][1:])
        rows.append((f"hard restart right after the start, 4 ranks, {how}", at_once, IMP, 0.5))
    goal = 3.0 if template else None
    return rows + [
        (f"push {args.mb} MB to 4 ranks, {how} (of pickling)", push, pick, goal),
        (f"pull 4 x {args.mb} MB, {how} (of pickling)", pull, pick, goal),
    ]


if __name__ == "__main__":
    main()
