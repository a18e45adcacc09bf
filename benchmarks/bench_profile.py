"""What ``%%dist_profile`` costs on top of ``torch.profiler`` alone, for a short training
loop.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_profile.py [--ranks 4] [--steps 20]
        [--repeats 5]

A session of ``--ranks`` CPU ranks; the loop trains a small MLP with DDP for ``--steps``
steps. Timed from the notebook's side, best of ``--repeats`` (interleaved):
  plain     ``session.run(loop)``
  torch     the loop inside ``torch.profiler.profile()`` on each rank, each exporting its
            own Chrome trace to /tmp (what a user does by hand: N files, N clocks)
  ours      ``session.profile(loop)``: the same profiler, plus clock samples, the Flight
            Recorder read, each rank's trace summarized and shifted to one clock, the tables
            and one merged file (its figure is drawn when shown: 0.3-0.5 s more in a notebook)
Target (issue 43): ours <= 1.2x torch's time (issue 31 asked 2x).

Where the time went (py-spy of the kernel and of rank 0, then each step timed; 4 ranks,
100 steps, this 2-core VM, 2026-11-26). Before: the kernel parsed the 4 traces (16.6k
events each, 4.2 MB), walked every event for the tables and encoded them again for
merged.json, one after another: ~1 s of the kernel's CPU (the tables 0.38 s, the JSON
0.3 s, the traces' trip 0.17 s) against torch's own 0.15 s. Now each rank, in parallel,
parses its own trace and sends a summary of a few kB (rank_trace.summarize: its window,
ops, compute spans and self times), the kernel aligns the clocks and makes the tables from
those (~60 ms), and each rank then shifts its events by the offset the kernel sent and
writes its own rankN.json and its part of the merged trace, which the kernel streams into
merged.json (~10 ms). Two finds on the way: the cyclic collector, set off by the 10^5
dicts of a parsed trace, walked every object of the rank (torch's too): a summary took
120-180 ms with it, 35 ms without (it is off while a trace's dicts are made); self times
sorted as tuples in C, not by a Python key.

What is left (100 steps, one run: plain 0.82 s, ours 1.29 s): the cell under the profiler
0.84 s; the stop 0.26 s, of which the profiler's own stop and export (torch's cost too,
paid inside its cell) and, per rank, reading and parsing 4.2 MB of JSON (~35 ms of CPU),
the summary (~30 ms); the write 0.09 s (per rank: shifting and encoding 16.6k events,
~45 ms, C's encoder); start, clock samples, tables and merge ~0.05 s. The floor of this
design on this machine: 4 ranks share 2 cores, so the ~110 ms of CPU each rank adds (parse,
summary, encode: C's JSON codec is two thirds of it) cost ~0.22 s of wall time, plus three
round trips to the ranks (start, stop, write: ~10-20 ms each). torch.profiler alone pays
none of these: its trace stays one unaligned file per rank. So ours is torch's time +
~0.3 s at 100 steps (~1.3x) and + ~0.1 s at 20 (~1.5x, the round trips dominate): the 1.2x
goal is not reached on 2 cores with 4 ranks; with a core per rank the parse/encode part
halves (it runs in parallel), which puts 100 steps near 1.2x.
Measured 2026-11-26, before (main) and after, back to back in one run, best of 5 each:
20 steps: torch alone 0.23 / 0.22 s, ours 0.41 -> 0.35 s: 1.79x -> 1.63x; 100 steps: torch
alone 0.98 / 0.93 s, ours 1.97 -> 1.34 s: 2.01x -> 1.43x (issue 43 had 1.76x / 1.82x; other
runs of this version: 1.51-1.53x and 1.33-1.42x).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

import infini_notebook

LOOP = """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
_mlp = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
_net = DDP(_mlp)
_opt = torch.optim.SGD(_net.parameters(), lr=0.01)
for _step in range({steps}):
    _opt.zero_grad()
    _net(torch.randn(64, 256)).sum().backward()
    _opt.step()
"""

TORCH_ALONE = """
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU]) as _prof:
{body}
_prof.export_chrome_trace(f"{folder}/rank{{rank}}.json")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    loop = LOOP.format(steps=args.steps)
    folder = tempfile.mkdtemp(prefix="bench_profile_")
    body = "\n".join("    " + line for line in loop.strip().splitlines())
    torch_alone = TORCH_ALONE.format(body=body, folder=folder)
    session = infini_notebook.start(nprocs=args.ranks, timeout=120)
    best = {"plain": float("inf"), "torch": float("inf"), "ours": float("inf")}
    try:
        session.run(loop, echo=False)  # warm: imports, DDP's first buckets
        for i in range(args.repeats):
            out = f"{folder}/ours{i}"
            for name, call in (
                ("plain", lambda: session.run(loop, echo=False)),
                ("torch", lambda: session.run(torch_alone, echo=False)),
                ("ours", lambda out=out: session.profile(loop, out=out, echo=False)),
            ):
                t0 = time.perf_counter()
                call()
                best[name] = min(best[name], time.perf_counter() - t0)
    finally:
        session.stop()
        shutil.rmtree(folder, ignore_errors=True)
    print(f"{args.ranks} ranks, {args.steps} DDP steps of a small MLP (best of {args.repeats})")
    for name, label in (("plain", "no profiler"), ("torch", "torch.profiler alone"),
                        ("ours", "%%dist_profile")):  # fmt: skip
        print(f"  {label:22s} {best[name]:6.2f} s  ({best[name] / best['plain']:.2f}x plain)")
    ratio = best["ours"] / best["torch"]
    print(f"target (ours <= 1.2x torch.profiler alone): {'met' if ratio <= 1.2 else 'MISSED'} "
          f"({ratio:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
