"""Push and pull of large tensors to local ranks, shared memory on and off, against pickling.

    .venv/bin/python benchmarks/bench_push_pull.py [--ranks 4] [--mb 100] [--repeats 5]

1. ``pickle.dumps`` of one float32 tensor of MB megabytes: the unit of the table.
2. push: ``session.push({"x": tensor})`` to every rank (CPU ranks, all on this host).
3. pull: ``session.pull("y")``, each rank holding its own tensor of MB megabytes; then the
   same followed by a read of every value (a value pulled through shared memory lies on a
   mapping whose pages are first touched then).
Each with shared memory (``shm_transport.enabled``) and without (ipyparallel's stream).
4. The floor of a push (issue 43): one write of the tensor's bytes into a new file in
   /dev/shm, the one copy a push makes (each rank then maps that file copy-on-write).
Targets: push and pull <= 3x the pickling time (issue 22); push <= 0.3x (issue 43).

Measured 2026-11-26 on this 2-core machine, 4 ranks, 100 MB, best of 3: pickle.dumps
0.116 s, push 0.050 s (0.43x), its floor 0.044 s (0.38x; 0.030-0.044 s over four runs),
so push is 1.12x its floor. tmpfs allocates
and zeroes each page as it is written, so one copy into shared memory costs a third of a
pickle here, and two or four threads writing halves do not beat one (0.034-0.042 s: the
writes to one tmpfs file are serialized on its inode). What a push adds to the floor is
one round trip to the ranks (~5-10 ms), so push stays within ~1.3x of its floor: the 0.3x
goal is at the floor of this machine, not reachable above it.
"""

from __future__ import annotations

import argparse
import gc
import os
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


def write_to_shm(x: torch.Tensor) -> None:
    """The floor of a push: the tensor's bytes written once into a new /dev/shm file."""
    path = f"/dev/shm/bench-push-floor-{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        data, done = memoryview(x.numpy()).cast("B"), 0
        while done < len(data):
            done += os.pwrite(fd, data[done:], done)
    finally:
        os.close(fd)
        os.unlink(path)


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
    floor = best(lambda: write_to_shm(x), args.repeats)
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
    push = results[True]["push"]
    print(
        f"  push's floor, one write into /dev/shm: {floor:.3f} s ({floor / dumps:.2f}x pickling);"
        f" push {push / dumps:.2f}x pickling, {push / floor:.2f}x its floor (goal <= 0.3x)"
    )


if __name__ == "__main__":
    main()
