"""Torch alone, no infini_notebook: two NCCL ranks on one GPU (distinct NCCL_HOSTID), rank 0
never joins an all_reduce, rank 1 waits in it (``.item()``), and both then do what a release
does: ``_abort_process_group()`` from a second thread, the groups dropped, a new default group
under a fresh store prefix, and an all_reduce on it. Prints each stage, so that a crash
(faulthandler prints the stack of a SIGSEGV) names where it happens; the variant picks how the
aborted groups are dropped.

    python3 scripts/nccl_release_probe.py [destroy|keep|split]

On torch 2.11 + NCCL 2.28.9 (H100, 2026-11-26) "destroy" runs to the end; inside a session
the rebuild crashed in ``split_group`` (see engine/bootstrap.init_distributed); "split" is
that step alone.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from datetime import timedelta


def say(rank: int, what: str) -> None:
    print(f"[rank {rank}] {time.monotonic():.2f} {what}", flush=True)


def rank_main(rank: int, port: int, variant: str) -> None:
    faulthandler.enable()
    os.environ.update(
        NCCL_HOSTID=f"probe-slot{rank}", NCCL_NET="Socket", NCCL_SOCKET_IFNAME="lo",
        NCCL_NVLS_ENABLE="0", TORCH_NCCL_ASYNC_ERROR_HANDLING="2", TORCH_FR_BUFFER_SIZE="2000",
    )  # fmt: skip
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    base = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))

    def init(n: int) -> None:
        dist.init_process_group(
            "nccl", store=dist.PrefixStore(f"attempt{n}", base), rank=rank, world_size=2,
            timeout=timedelta(seconds=60), device_id=device,
        )  # fmt: skip

    init(0)
    x = torch.ones(1, device=device)
    dist.all_reduce(x)
    say(rank, f"warm all_reduce {x.item()}")
    kept = []

    def abort() -> None:
        time.sleep(2)
        say(rank, "abort")
        dist.distributed_c10d._abort_process_group()
        say(rank, "aborted")

    threading.Thread(target=abort).start()
    if rank == 1:
        dist.all_reduce(x)
        say(rank, "waiting in .item()")
        say(rank, f".item() returned {x.item()}")
    time.sleep(3)
    if variant == "keep":
        kept.append(x)
    say(rank, f"initialised after abort: {dist.is_initialized()}")
    if dist.is_initialized():
        dist.destroy_process_group()
        say(rank, "destroyed")
    init(1)
    say(rank, "re-initialised")
    y = torch.full((1,), float(rank + 1), device=device)
    dist.all_reduce(y)
    say(rank, f"all_reduce after the rebuild: {y.item()} (3.0 expected)")
    if variant == "split":  # what groups.py does next on a device-bound default group
        sub = dist.split_group(split_ranks=[[0, 1]], timeout=timedelta(seconds=60))
        say(rank, "split")
        dist.all_reduce(y, group=sub)
        say(rank, f"all_reduce on the split group: {y.item()} (6.0 expected)")
    dist.destroy_process_group()
    say(rank, "done")


if __name__ == "__main__":
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    variant = sys.argv[1] if len(sys.argv) > 1 else "destroy"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, free, variant)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    print("exit codes", [p.exitcode for p in procs], flush=True)
