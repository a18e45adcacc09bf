"""Regenerate the tutorial notebooks from these sources, then run them to fill the outputs.

    .venv/bin/python scripts/notebook_sources/build.py            # write and execute all
    .venv/bin/python scripts/notebook_sources/build.py 02 06      # only these
    .venv/bin/python scripts/notebook_sources/build.py --no-run   # write sources only

Each ``nbNN_*.py`` here defines ``NAME`` and ``CELLS``; the executed notebooks (with the
outputs of a real CPU run) are what gets committed.
"""

from __future__ import annotations

import argparse
import glob
import os
import runpy
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _nb import REPO, save  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("only", nargs="*", help="notebook numbers, e.g. 02 06 (default all)")
    parser.add_argument("--no-run", action="store_true", help="write sources, do not execute")
    args = parser.parse_args()
    paths = []
    for src in sorted(glob.glob(os.path.join(HERE, "nb[0-9][0-9]_*.py"))):
        number = os.path.basename(src)[2:4]
        if args.only and number not in args.only:
            continue
        spec = runpy.run_path(src)
        paths.append(save(spec["NAME"], spec["CELLS"]))
        print("wrote", os.path.relpath(paths[-1], REPO))
    if args.no_run or not paths:
        return 0
    runner = os.path.join(REPO, "scripts", "run_notebooks.py")
    return subprocess.call([sys.executable, runner, *paths, "--inplace"], cwd=REPO)


if __name__ == "__main__":
    sys.exit(main())
