"""Threads per rank: one rule on every start, warm or cold, computed where the rank runs.
``--threads N``, else the CPUs this process may use on its host (its affinity: a cgroup's
cpuset or taskset counts) shared by the ranks on that host. torch's intra-op pool, OpenMP
and BLAS all take it: the environment for libraries loaded later and child processes
(engine.bootstrap.engine_environment), and the pools already started here."""

from __future__ import annotations

import os


def per_rank(cfg: dict, cpus: int | None = None) -> int:
    if cfg.get("threads"):
        return int(cfg["threads"])
    cpus = cpus or len(os.sched_getaffinity(0))
    return max(1, cpus // max(1, int(cfg.get("local_world_size") or 1)))


def apply(threads: int) -> None:
    """torch's pool, and the BLAS and OpenMP pools already started in this process
    (numpy's OpenBLAS: one thread in a rank forked from the warm template, one per CPU in
    a new process), through threadpoolctl where it is installed."""
    import torch

    torch.set_num_threads(threads)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return
    threadpool_limits(threads)


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()
