"""Attach time of a kept session (issue 42), from a new process as a new kernel meets it.

    .venv/bin/python benchmarks/bench_attach.py [--ranks 8] [--repeats 3]

A process starts ``--nprocs N --name bench-attach --keep 5m`` and dies with ``os._exit`` (as
a killed kernel); then, per repeat, a fresh interpreter attaches the session, runs one
``%%dist`` cell on every rank, and exits without stopping it (the next one attaches again).
Two figures per attach: ``cluster.attach`` alone (once torch, torch.distributed and
ipyparallel are imported: a kernel that used them already), and the whole from a bare
interpreter (those imports included). The session is stopped at the end.
Target: attach at 8 ranks <= 1 s (Monarch: 12-23 s to bring its meshes back).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

NAME = "bench-attach"

START = """\
import os, infini_notebook
s = infini_notebook.start(nprocs={n}, timeout=60, name={name!r}, keep="5m")
s.run("x = rank", echo=False)
os._exit(0)
"""

ATTACH = """\
import json, os, time
t0 = time.perf_counter()
import torch.distributed, ipyparallel  # what a kernel that used them has imported
from infini_notebook import cluster
t1 = time.perf_counter()
s, line = cluster.attach({name!r}, force=True)
t2 = time.perf_counter()
s.run("y = x + 1", echo=False)
t3 = time.perf_counter()
print(json.dumps({{"imports": t1 - t0, "attach": t2 - t1, "cell": t3 - t2, "line": line}}))
os._exit(0)  # the kernel dies again: the session stays for the next attach
"""


def run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"exit code {done.returncode}:\n{done.stderr[-3000:]}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    t0 = time.perf_counter()
    run(START.format(n=args.ranks, name=NAME))
    print(f"kept session of {args.ranks} CPU ranks started in {time.perf_counter() - t0:.1f}s")
    results = []
    try:
        for _ in range(args.repeats):
            lines = run(ATTACH.format(name=NAME)).splitlines()
            results.append(json.loads(lines[-1]))
    finally:
        from infini_notebook.launch import kept_sessions

        kept_sessions.stop(NAME)
    print(results[0]["line"])
    print(f"\nattach, {args.ranks} CPU ranks (best of {args.repeats}; target <= 1.0 s):")
    best = min(results, key=lambda r: r["attach"])
    whole = min(r["imports"] + r["attach"] for r in results)
    print(f"  cluster.attach (imports done):         {best['attach']:6.2f} s")
    print(f"  from a bare interpreter (with imports): {whole:6.2f} s")
    print(f"  first cell after attach:               {best['cell']:6.2f} s")


if __name__ == "__main__":
    main()
