"""Bringing the ranks up on their engines (``bring_up``: the watchdog armed, the engines
started, the ranks bootstrapped): each rank's bootstrap config, the bootstrap itself (its
progress, and the first rank that failed with what it printed), the table of ranks it
yields, and the folders a failed start of ssh engines leaves on their hosts. Functions over
the owners (plan, Engines, Rendezvous, SessionFolder); the Session records the table in its
RankBook."""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent import futures

import psutil

from ..core.errors import DistCellError
from ..core.layout import ParallelLayout
from ..core.output import error_report, one_line, remote_traceback
from ..core.plan import LOOPBACK, SessionPlan
from ..core.state import Progress, RankState
from ..engine import bootstrap
from . import launchers
from .engine_sets import Engines
from .folder import SessionFolder
from .rendezvous import Rendezvous
from .watchdog import FOLDER_PREFIX

log = logging.getLogger("infini_notebook")


def engine_config(
    plan: SessionPlan, rdzv: Rendezvous, folder: SessionFolder, rank: int, relay=None
) -> dict:
    """What rank ``rank``'s bootstrap is given (engine/bootstrap.py); ``relay``: the
    session's RelayLink with --relay (where the rank reaches its host's relay)."""
    # what a rank watches: the kernel, or for a kept session its watchdog (see keep.py)
    kernel = folder.guard() if plan.keep_s else psutil.Process()
    world = plan.world_size
    group_rank, local_rank, local_world = plan.placement.rank_places(world)[rank]
    return {
        "rank": rank,
        "local_rank": local_rank,
        "world_size": world,
        "local_world_size": local_world,
        "group_rank": group_rank,
        "watch": "store" if plan.placement.multi_host else "pid",
        "loopback_only": plan.bind_address in LOOPBACK,
        "backend": plan.backend,
        "timeout": plan.timeout,
        "cuda": plan.cuda_devices(rank),
        # ranks sharing a GPU: NCCL's host id per slot (devices.sharing_env); the folder's
        # random name keeps two sessions' ids apart
        "nccl_sharing": plan.sharing_env(rank, os.path.basename(folder.path)),
        "memory_fraction": plan.gpu_memory_fraction,
        "threads": plan.threads,
        **rdzv.engine_fields(),
        "layout": plan.layout,
        "kernel_pid": kernel.pid,
        "kernel_start": kernel.create_time(),
        "stack_file": folder.stack_file(rank, plan.placement.multi_host),
        # --relay: where the rank takes cells from and sends their answers (relay.py)
        "relay": relay.addresses(rank) if relay is not None else None,
    }


def bring_up(
    plan: SessionPlan,
    engines: Engines,
    rdzv: Rendezvous,
    folder: SessionFolder,
    progress: Progress | None = None,
) -> list[RankState]:
    """The watchdog armed, the engines up, every rank bootstrapped (a start, and what a hard
    restart redoes); the table of ranks."""
    folder.arm_watchdog()
    engines.start(progress)
    return bootstrap_ranks(plan, engines, rdzv, folder, progress)


def bootstrap_ranks(
    plan: SessionPlan,
    engines: Engines,
    rdzv: Rendezvous,
    folder: SessionFolder,
    progress: Progress | None = None,
) -> list[RankState]:
    """Every rank set up on its engine (process groups, namespace); the table of ranks."""
    configs = {
        r: engine_config(plan, rdzv, folder, r, engines.relay) for r in range(plan.world_size)
    }
    with engines.client.lock:
        pending = {r: engines.view(r).apply_async(bootstrap.bootstrap, configs[r]) for r in configs}
    failed = wait_for_bootstrap(plan, pending, progress)
    if failed is not None:  # the others wait for it until the timeout: the caller stops them
        raise bootstrap_error(plan, engines, failed, pending[failed])
    infos = engines.client.gather(pending, what="start", timeout=plan.timeout + 60, log=False)
    return rank_table(plan, engines, infos)


def wait_for_bootstrap(plan: SessionPlan, pending: dict, progress: Progress | None) -> int | None:
    """Wait until every rank is set up; the first rank that failed, if one did."""
    deadline = time.monotonic() + plan.timeout + 60
    while (done := sum(ar.ready() for ar in pending.values())) < len(pending):
        if progress:
            progress(done, len(pending), "ranks initialised")
        failed = [r for r, ar in pending.items() if ar.ready() and not ar.successful()]
        if failed:
            return failed[0]
        left = deadline - time.monotonic()
        if left <= 0:
            break  # the gather names the ranks that never answered
        # woken by the next rank that answers (an AsyncResult is a Future): a poll every
        # 50 ms cost a start or hard restart 25 ms on average
        futures.wait(
            [ar for ar in pending.values() if not ar.ready()],
            timeout=min(left, 1.0),
            return_when=futures.FIRST_COMPLETED,
        )
    if progress:
        progress(done, len(pending), "ranks initialised")
    return next((r for r, ar in pending.items() if not ar.successful()), None)


def bootstrap_error(
    plan: SessionPlan, engines: Engines, rank: int, ar, lines: int = 20
) -> DistCellError:
    """A rank failed to set up: its error, with the end of what it printed before."""
    try:
        ar.get(timeout=0)
        error: BaseException = RuntimeError("failed")
    except Exception as e:
        error = e
    ar.wait_for_output(timeout=0.5)  # output trails the reply a little
    md = ar.metadata[0] if isinstance(ar.metadata, list) else ar.metadata
    printed = "".join((md.get("stdout") or "", md.get("stderr") or ""))
    tail = "".join(printed.splitlines(True)[-lines:])
    report = error_report({rank: f"{tail}{remote_traceback(error)}"})
    engines.client.forget(ar.msg_ids)
    return DistCellError(
        f"Starting {plan.world_size} ranks failed on rank {rank}: {one_line(error)}. "
        f"The other ranks were stopped. {launchers.start_advice(plan)}",
        report,
        [rank],
    )


def host_name(plan: SessionPlan, rank: int, reported: str) -> str:
    """The host as the user named it in --hosts (two hosts may share a hostname)."""
    place = plan.placement
    if not place.multi_host or place.launcher == "slurm":  # Slurm picks the nodes
        return reported
    return place.hosts[place.rank_places(plan.world_size)[rank][0]][0]


def rank_table(plan: SessionPlan, engines: Engines, infos: dict[int, dict]) -> list[RankState]:
    """What each rank reported at bootstrap, as RankState rows; its process adopted when it
    is ours here (a remote pid means nothing on this host)."""
    layout = ParallelLayout(**plan.layout)
    rows = []
    for r in range(plan.world_size):
        info = infos[r]
        if info["pid"]:  # 0: a rank that did not answer (see kernel/attach.py)
            engines.adopt(r, info["pid"])
        rows.append(
            RankState(
                rank=r,
                pid=info["pid"],
                host=host_name(plan, r, info["host"]),
                device=info["device"],
                device_name=info["device_name"],
                memory_used=info["memory_used"],
                state="idle",
                coords=layout.coords(r),
                gpu=plan.physical_gpu(r),
                threads=info.get("threads"),
            )
        )
    return rows


def remote_folder_removers(engines: Engines) -> list:
    """The ssh connections (one per host) of ssh engines, to remove the engines' folder on
    their hosts (see ssh.py) once ipyparallel has fetched their output at stop: the engines
    remove it themselves once their rank is set up, so only a failed start leaves one.
    Taken before the engines stop: their launchers go."""
    senders = {}
    cluster = engines.client.cluster
    for engine_set in (cluster.engines if cluster else {}).values():
        for launcher in getattr(engine_set, "launchers", {}).values():
            if hasattr(launcher, "ssh_sender") and hasattr(launcher, "location"):
                senders.setdefault(launcher.location, launcher)
    return list(senders.values())


def remove_remote_folders(launchers: list, timeout: float = 10) -> None:
    """Remove the engines' folder on each ssh host (see remote_folder_removers); only a
    folder named as a session's, and not waiting more than ``timeout`` for a host."""

    def remove(launcher) -> None:
        folder = os.path.dirname(os.path.normpath(launcher.remote_profile_dir))
        if not os.path.basename(folder).startswith(FOLDER_PREFIX):
            return
        try:
            launcher.ssh_sender.cmd_rmdir(folder)
        except Exception as e:
            log.info("removing the engines' folder on %s: %s", launcher.location, e)

    threads = [threading.Thread(target=remove, args=(x,), daemon=True) for x in launchers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
