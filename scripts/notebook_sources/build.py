"""Regenerate the tutorial notebooks from these sources and run them to fill the outputs.

    .venv/bin/python scripts/notebook_sources/build.py            # write and execute all
    .venv/bin/python scripts/notebook_sources/build.py 02 06      # only these
    .venv/bin/python scripts/notebook_sources/build.py --no-run   # write sources only

Each ``nbNN_*.py`` here defines ``NAME`` and ``CELLS``. The notebooks are executed as
``scripts/run_notebooks.py`` does, then made static for code hosts: GitHub and nbconvert
cannot draw live widgets (a widget output renders blank), so a widget output keeps its
static HTML/text fallback when it has one and is dropped when it has none (the engine
progress bar of ``%dist_start``), and the saved widget state goes. Re-running the notebook
in Jupyter brings the live widgets back.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import runpy
import sys
import time

import nbformat

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _nb import REPO, save  # noqa: E402


def _run_notebooks():
    """scripts/run_notebooks.py, so both run notebooks the same way."""
    spec = importlib.util.spec_from_file_location(
        "run_notebooks", os.path.join(REPO, "scripts", "run_notebooks.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("only", nargs="*", help="notebook numbers, e.g. 02 06 (default all)")
    parser.add_argument("--no-run", action="store_true", help="write sources, do not execute")
    args = parser.parse_args()
    for src in sorted(glob.glob(os.path.join(HERE, "nb[0-9][0-9]_*.py"))):
        number = os.path.basename(src)[2:4]
        if args.only and number not in args.only:
            continue
        spec = runpy.run_path(src)
        path = save(spec["NAME"], spec["CELLS"])
        print("wrote", os.path.relpath(path, REPO), flush=True)
        if args.no_run:
            continue
        t0 = time.perf_counter()
        runner = _run_notebooks()
        nb = runner.static_outputs(runner.execute(path, 600))
        nbformat.write(nb, path)
        print(f"executed {os.path.relpath(path, REPO)} in {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
