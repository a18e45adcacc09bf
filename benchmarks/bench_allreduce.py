"""%dist_bench against a plain torch.distributed loop: 1 MiB all_reduce on 4 gloo ranks
(or one rank per GPU on nccl with --gpus N, where %dist_bench times with CUDA events).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_allreduce.py [--nprocs 4 | --gpus N]
        [--iters 50] [--repeats 15]

Both run on the same engines in one process, interleaved so that both see the same machine
load: ``%dist_bench all_reduce --sizes 1M`` (its reported time per iteration) and a loop
typed into ``%%dist`` (barrier; perf_counter; all_reduce x iters; barrier; mean over ranks).
The headline is the best of each (timeit's rule: other load only adds time); the median of
the per-pair ratios (each run of ours over the plain run beside it) cancels slow drifts
of the machine's load.
Target (issue 43): 1.00 +- 0.05 (issue 4 asked at most 1.10). On one H200, NCCL, 1 MiB:
ratio 0.71 at 50 iters, 0.89 at 500 (the plain loop's closing synchronize and barrier count
in its time; more --iters narrow the gap).

Profile (py-spy, rank 0 and the kernel, 5 interleaved pairs on this 2-core VM, 2026-11-26):
the rank's main thread spends its time in ``all_reduce`` in both (2.06 s under
``engine_step``, 2.21 s under the cell's ``<module>``, which also holds the cell's warm-up
allocation), the same threads run beside both (ipykernel's IOPub/Control and fd watchers,
the store's stack answerer and the 1 s telemetry thread, all parked), and the kernel only
waits during either (``Condition.wait``; the cell's prompt poll is one store check per
0.1 s). ``engine_step`` is the plain loop: the same warm-up, barrier, perf_counter and
closing barrier, with one lambda call per iteration (~0.1 µs against ~5 ms). What is left
is the noise of 4 CPU-bound ranks on 2 cores: single runs spread by +-10 %.
Measured 2026-11-26 on this 2-core VM (4 gloo ranks, 50 iters, 15 pairs, one run): best
plain 5080 µs/iter, %dist_bench 4942 µs/iter, ratio 0.973; median of the pair ratios 0.991:
met. Issue 43's 1.23x did not reproduce (0.94 and 1.05 in two earlier runs of 9 pairs, the
second beside another job).
"""

from __future__ import annotations

import argparse
import statistics
import time

SIZE = 1 << 20  # 1 MiB of float32

PLAIN_LOOP = """
import time
_x = torch.zeros({count}, dtype=torch.float32, device=device)
for _ in range({warmup}):
    dist.all_reduce(_x)
_sync = torch.cuda.synchronize if _x.is_cuda else (lambda: None)
_sync(); dist.barrier()
_t0 = time.perf_counter()
for _ in range({iters}):
    dist.all_reduce(_x)
_sync(); dist.barrier()
plain_s = (time.perf_counter() - _t0) / {iters}
"""


def plain(session, iters: int, warmup: int) -> float:
    """Seconds per all_reduce, as a user would time it by hand, averaged over ranks."""
    session.run(PLAIN_LOOP.format(count=SIZE // 4, iters=iters, warmup=warmup), echo=False)
    per_rank = session.pull("plain_s")
    return sum(per_rank.values()) / len(per_rank)


def ours(shell, iters: int, warmup: int) -> tuple[float, float]:
    """(reported seconds per all_reduce, wall seconds of the whole magic call)."""
    from IPython.utils.capture import capture_output

    t0 = time.perf_counter()
    with capture_output():  # the table and the figure
        shell.run_line_magic(
            "dist_bench", f"all_reduce --sizes 1M --iters {iters} --warmup {warmup} -o _bench_df"
        )
    wall = time.perf_counter() - t0
    df = shell.user_ns["_bench_df"]
    assert len(df) == 1 and df["size_bytes"].iloc[0] == SIZE, df
    return df["time_us"].iloc[0] * 1e-6, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=4)
    parser.add_argument("--gpus", type=int, default=None, help="one rank per GPU, nccl")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()

    from IPython.testing.globalipapp import start_ipython

    import infini_notebook

    shell = start_ipython()
    shell.run_line_magic("load_ext", "infini_notebook")
    where = {"gpus": args.gpus} if args.gpus else {"nprocs": args.nprocs}
    session = infini_notebook.start(**where)
    try:
        mine, hand, walls = [], [], []
        for _ in range(args.repeats):  # alternate so neither side gets a quieter machine
            t, wall = ours(shell, args.iters, args.warmup)
            mine.append(t)
            walls.append(wall)
            hand.append(plain(session, args.iters, args.warmup))
        report(args, mine, hand, walls)
    finally:
        session.stop()


def ranks_text(args) -> str:
    return f"{args.gpus} nccl ranks" if args.gpus else f"{args.nprocs} gloo ranks"


def report(args, mine: list[float], hand: list[float], walls: list[float]) -> None:
    """Best of N is the headline (timeit's rule: other load only ever adds time); medians
    are printed beside it to show the noise."""
    print(
        f"\n1 MiB float32 all_reduce, {ranks_text(args)}, {args.iters} iters, "
        f"{args.repeats} interleaved runs each:"
    )
    for name, f in (("best", min), ("median", statistics.median)):
        m, h = f(mine), f(hand)
        print(
            f"  {name:>6}: plain loop {h * 1e6:8.1f} us/iter, %dist_bench {m * 1e6:8.1f} "
            f"us/iter, ratio {m / h:.3f}"
        )
    paired = statistics.median(m / h for m, h in zip(mine, hand))
    print(f"  paired: median of the {len(mine)} per-pair ratios {paired:.3f}")
    runs_us = [round(x * 1e6) for x in mine], [round(x * 1e6) for x in hand]
    print(f"  runs (us): ours {runs_us[0]}\n             plain {runs_us[1]}")
    print(f"  %dist_bench wall per call, table and PNG included: {statistics.median(walls):.2f} s")
    ratio = min(mine) / min(hand)
    met = abs(ratio - 1) <= 0.05
    print(f"  target (issue 43): 1.00 +- 0.05 -> {'met' if met else 'MISSED'} ({ratio:.3f})")
    if ratio < 0.90:  # seen on one H200: 0.71 at 50 iters, 0.89 at 500
        print(
            "  (faster than the plain loop: its closing synchronize and barrier, a fixed cost "
            "per run, count in its time; more --iters narrow the gap)"
        )


if __name__ == "__main__":
    main()
