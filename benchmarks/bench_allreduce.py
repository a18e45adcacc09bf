"""%dist_bench against a plain torch.distributed loop: 1 MiB all_reduce on 4 gloo ranks
(or one rank per GPU on nccl with --gpus N, where %dist_bench times with CUDA events).

    .venv/bin/python benchmarks/bench_allreduce.py [--nprocs 4 | --gpus N] [--iters 50]

Both run on the same engines in one process, interleaved so that both see the same machine
load: ``%dist_bench all_reduce --sizes 1M`` (its reported time per iteration) and a loop
typed into ``%%dist`` (barrier; perf_counter; all_reduce x iters; barrier; mean over ranks).
Target (issue 4): our time at most 10% over the plain loop's. Below it is no fault: the
plain loop's closing synchronize and barrier count in its time (on one H200, NCCL, 1 MiB:
ratio 0.71 at 50 iters, 0.89 at 500).
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
    parser.add_argument("--repeats", type=int, default=9)
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
    runs_us = [round(x * 1e6) for x in mine], [round(x * 1e6) for x in hand]
    print(f"  runs (us): ours {runs_us[0]}\n             plain {runs_us[1]}")
    print(f"  %dist_bench wall per call, table and PNG included: {statistics.median(walls):.2f} s")
    ratio = min(mine) / min(hand)
    print(f"  target: %dist_bench at most 10% slower -> {'PASS' if ratio <= 1.10 else 'FAIL'}")
    if ratio < 0.90:  # seen on one H200: 0.71 at 50 iters, 0.89 at 500
        print(
            "  (faster than the plain loop: its closing synchronize and barrier, a fixed cost "
            "per run, count in its time; more --iters narrow the gap)"
        )


if __name__ == "__main__":
    main()
