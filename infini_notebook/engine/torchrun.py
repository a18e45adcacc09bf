"""The names a rank gets, under a session (engines) or under torchrun (exported scripts):
``rank_namespace``, ``torchrun_namespace``, and ``[rank N]`` labels on printed lines.

Torch is imported inside the functions: engines import this module before their
environment (CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS) is set.
"""

from __future__ import annotations

import contextlib
import os
import sys
from datetime import timedelta


def rank_namespace(layout, device, local_rank: int, timeout=None) -> dict:
    """The names a ``%%dist`` cell sees: torch, dist, rank, world_size, local_rank, device,
    groups, mesh, layout. Builds the parallel groups (collective: every rank calls it, after
    ``dist.init_process_group``). Engines and ``torchrun_namespace`` both use it."""
    import torch
    import torch.distributed as dist

    from ..groups import init_parallel_groups

    groups = init_parallel_groups(layout, timeout=timeout)  # every group, not only the world
    return {
        "torch": torch,
        "dist": dist,
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "local_rank": local_rank,
        "device": device,
        "groups": groups,
        "mesh": groups.mesh,
        "layout": layout,
    }


def torchrun_namespace(
    layout,
    *,
    backend: str = "auto",
    timeout: float = 300.0,
    label_output: bool = True,
    gpus=None,
) -> dict:
    """Under torchrun: the same names a session's rank has (see ``rank_namespace``).

    Initialises the default group from torchrun's environment with ``backend`` and
    ``timeout`` (seconds), then builds ``layout``'s groups. The device: with ``gpus`` (a
    CUDA_VISIBLE_DEVICES entry per rank, a session's ``--gpus``), the GPU the session's rank
    had (``use_gpus``); else one GPU per local rank for nccl, the CPU for gloo.
    ``label_output`` prefixes every line this rank prints with ``[rank N]``, as the notebook
    does. Scripts written by ``%dist_export`` start with it."""
    import torch
    import torch.distributed as dist

    from ..core.errors import DistUsageError
    from ..core.layout import ParallelLayout

    if not isinstance(layout, ParallelLayout):
        layout = ParallelLayout.from_dict(layout)
    env = os.environ
    n = layout.world_size
    if "RANK" not in env or "LOCAL_RANK" not in env:
        raise DistUsageError(f"Run this script with torchrun: torchrun --nproc_per_node {n} FILE")
    if int(env.get("WORLD_SIZE", -1)) != n:
        raise DistUsageError(
            f"This script needs {n} ranks (its layout: {layout.describe()}), but torchrun "
            f"started {env.get('WORLD_SIZE')}: run it with torchrun --nproc_per_node {n} "
            f"(or --nnodes M --nproc_per_node N with M x N = {n})."
        )
    local_rank = int(env["LOCAL_RANK"])
    if label_output:
        label_streams(f"[rank {env['RANK']}]")
    if gpus:  # before anything starts CUDA: it reads CUDA_VISIBLE_DEVICES once
        device = torch.device("cuda", use_gpus(gpus, backend, env))
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not gpus:
        device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        timeout=timedelta(seconds=timeout),
        device_id=device if device.type == "cuda" else None,
    )
    if "gloo" in backend:
        import atexit

        atexit.register(let_gloo_workers_finish)
    return rank_namespace(layout, device, local_rank)


def use_gpus(gpus, backend: str, env) -> int:
    """Make this torchrun rank see the GPUs a session's ranks saw (CUDA_VISIBLE_DEVICES in
    ``env``, and NCCL's settings for ranks sharing a GPU, ``--gpus 0,0``): its device index,
    as the session's rank had it (core/devices.rank_gpu). ``gpus``: a CUDA_VISIBLE_DEVICES
    entry per rank, on one machine. Call it before anything starts CUDA."""
    from ..core.devices import rank_gpu, sharing_env
    from ..core.errors import DistUsageError

    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    if len(gpus) != world or int(env.get("LOCAL_WORLD_SIZE", world)) != world:
        raise DistUsageError(
            f"GPUS picks {len(gpus)} GPUs of one machine (the notebook's --gpus), and torchrun "
            f"started {env.get('LOCAL_WORLD_SIZE')} of {world} ranks here: run the script on "
            "one machine, or set GPUS = None to give each rank cuda:LOCAL_RANK."
        )
    visible, index = rank_gpu(list(gpus), rank)
    env["CUDA_VISIBLE_DEVICES"] = visible
    if backend != "gloo":  # ranks sharing a GPU, on nccl (a user's own setting stays)
        run = env.get("TORCHELASTIC_RUN_ID", "script")
        for key, value in sharing_env(list(gpus), rank, _nccl_version(), run).items():
            env.setdefault(key, value)
    return index


def _nccl_version() -> tuple[int, ...] | None:
    """The NCCL this torch loads (no CUDA context needed), None without one."""
    try:
        import torch

        return tuple(torch.cuda.nccl.version())
    except Exception:  # a CPU wheel
        return None


@contextlib.contextmanager
def profiled(folder: str, device):
    """An exported ``%%dist_profile`` cell under torch.profiler, as the notebook ran it (CPU
    ops, CUDA ops on a GPU); this rank's trace goes to ``folder/rankN.json`` (0700 folder,
    0600 file, made here), also when the cell raises. Rank 0 says where on stderr."""
    import torch.distributed as dist

    from . import own_files, profiling

    prof = profiling.new_profiler(device.type == "cuda")
    prof.start()
    try:
        yield prof
    finally:
        prof.stop()
        text, _ = profiling.exported_trace(prof)
        os.makedirs(folder, 0o700, exist_ok=True)
        rank = dist.get_rank()
        path = own_files.write_text(folder, f"rank{rank}.json", text)
        if rank == 0:
            print(f"trace of this cell: {path} (one per rank)", file=sys.stderr)


GLOO_SETTLE_S = 0.2  # a waiting worker wakes within ms; margin for a loaded machine


def let_gloo_workers_finish() -> None:
    """At exit, before the interpreter finalizes: give gloo's worker threads the GIL.

    A gloo worker thread frees a finished collective's Work after the rank has moved on; if
    the Work holds the last reference to a tensor Python let go of, freeing it takes the GIL
    (``TensorImpl::decref_pyobject``). Once ``Py_FinalizeEx`` has begun, a thread that takes
    the GIL is made to exit, which unwinds through that (noexcept) destructor: libstdc++'s
    "terminate called without an active exception", SIGABRT, and torchrun reports the run
    failed after it printed everything (a core dump of tutorial 07's exported script, torch
    2.13: ``runLoop`` -> ``~AsyncAllgatherCoalescedWork`` -> ``gil_scoped_acquire`` ->
    ``PyThread_exit_thread``; the same race pytorch/pytorch#179291 describes, and
    ``destroy_process_group`` does not join the workers). Exit handlers run while other
    threads may still take the GIL, so sleeping here hands it to a worker already waiting
    for it (CPython's forced switch), and to one that finishes within the pause."""
    import time

    time.sleep(GLOO_SETTLE_S)


class LabeledStream:
    """Wraps a text stream: each complete line goes out prefixed with ``label``, one line per
    write and flush, so lines of ranks sharing a terminal or pipe do not cut into each other."""

    def __init__(self, stream, label: str):
        self.stream, self.label, self._partial = stream, label, ""

    def write(self, text: str) -> int:
        from ..core.output import prefix_lines

        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            self.stream.write(prefix_lines(self.label, line))
            self.stream.flush()
        return len(text)

    def finish(self) -> None:
        """Write an unfinished last line (at exit)."""
        if self._partial:
            self.write("\n")

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str):  # fileno, isatty, encoding ... of the real stream
        return getattr(self.stream, name)


def label_streams(label: str) -> None:
    """Prefix everything this process prints (stdout and stderr) with ``label``."""
    import atexit

    for name in ("stdout", "stderr"):
        stream = LabeledStream(getattr(sys, name), label)
        setattr(sys, name, stream)
        atexit.register(stream.finish)
