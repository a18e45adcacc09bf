"""Edited code on every rank (issue 42.8): edit a module, the next cell runs the new code.

    .venv/bin/python benchmarks/bench_autoreload.py [--ranks 8] [--edits 10]

(in the venv that ``scripts/test.sh`` makes). Goal: at 8 ranks, the cell after an edit takes
<= 1 s more than the same cell with autoreload off (Monarch: 3.3-4.85 s to re-apply code).

A notebook folder in a temporary folder holds ``armod.py`` (200 small functions); a session
of N CPU ranks starts there and imports it on every rank. Baseline: the median of
``--edits`` cells calling ``armod.f()`` with autoreload off. Then, per edit, the file is
rewritten (a new return value) and the next cell's time taken, its answer checked on every
rank: with ``session.set_autoreload(True)`` (the ranks see the folder: IPython's autoreload
alone), then with ``copy_all=True`` (every rank gets the changed file sent before the cell,
as ranks on other hosts do). Prints one line: the medians' overhead over the baseline.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

BODY = "".join(f"def g{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(200))


def write(folder: str, n: int) -> None:
    """Version ``n``: its own return value, and its own size (Python checks cached bytecode
    by size and whole seconds; the edits here come faster)."""
    with open(os.path.join(folder, "armod.py"), "w") as f:
        f.write(f"{BODY}def f():\n    return {n}\n{'#' * n}\n")


def timed_cell(s, expect: int | None) -> float:
    t0 = time.perf_counter()
    result = s.run("armod.f()", echo=False)
    elapsed = time.perf_counter() - t0
    if expect is not None:
        said = {r: data.get("text/plain") for r, data in result.results.items()}
        assert said == {r: str(expect) for r in range(s.world_size)}, said
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--edits", type=int, default=10)
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="bench-autoreload-")
    write(folder, 1)
    os.chdir(folder)
    import infini_notebook

    s = infini_notebook.start(nprocs=args.ranks, timeout=60)
    try:
        s.engines.standby.launch.result(120)  # spares forked once idle: not during timing
        while len(s.engines.client.ids() - s.engines.standby.known) < args.ranks:
            time.sleep(0.05)
        s.run(f"import sys\nsys.path.insert(0, {folder!r})\nimport armod", echo=False)
        base = statistics.median(timed_cell(s, 1) for _ in range(args.edits))
        figures = []
        version = 1
        for copy_all in (False, True):
            s.set_autoreload(True, copy_all=copy_all)
            timed_cell(s, version)  # the first copy (copy_all) is not an edit
            times = []
            for _ in range(args.edits):
                version += 1
                write(folder, version)
                times.append(timed_cell(s, version))
            figures.append(statistics.median(times) - base)
    finally:
        s.stop()
        shutil.rmtree(folder, ignore_errors=True)
    print(
        f"autoreload, {args.ranks} CPU ranks: edit a module -> the next cell runs the new code "
        f"on every rank in +{figures[0]:.3f} s over the same cell with autoreload off "
        f"({base:.3f} s), +{figures[1]:.3f} s with the file sent to every rank (as to other "
        f"hosts); median of {args.edits}; goal <= 1 s (Monarch: 3.3-4.85 s)"
    )


if __name__ == "__main__":
    main()
