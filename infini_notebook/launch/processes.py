"""The session's processes and the plumbing to them: the TCPStore hosted in the kernel, the
ipyparallel controller, bootstrapping the ranks on their engines (engine_sets.py starts and
stops those), and the client every call goes through (its event loop, views, gathering
replies, purging finished work). Plain functions taking the Session."""

from __future__ import annotations

import glob
import logging
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import psutil

from ..core import internals
from ..core.errors import DistCellError, DistUsageError
from ..core.output import error_report, error_summary, one_line, remote_traceback
from ..core.plan import LOOPBACK, SessionPlan, is_loopback
from ..core.state import Progress, RankState
from ..engine import bootstrap, rank_services
from ..kernel import supervision

log = logging.getLogger("infini_notebook")

DIGEST_HISTORY = 2**14
HUB_PURGE_DELAY_S = 1.0  # a cell's records stay on the controller this long at most
# private: ipyparallel's own requests (queue_status, purge_hub_results) can wait for ever
_QUERY_PARTS = ("_send", "_query_stream")


@dataclass
class Engines:
    """The ipyparallel side of a session, changed by this module alone: the controller
    (``Cluster``), the client and the lock every use of it holds (ipyparallel's Client is not
    thread-safe, and the foreground cell, a --background cell's thread and the status
    widget's poller all use it), the event loop ipyparallel runs on (see ``in_loop``), each
    rank's engine id and local process, and finished work waiting for a purge."""

    cluster: Any = None
    client: Any = None
    lock: threading.RLock = field(default_factory=threading.RLock)
    loop: Any = None
    eids: list[int] = field(default_factory=list)  # engine id of each rank
    pids: dict[int, psutil.Process] = field(default_factory=dict)  # ranks on this host
    unpurged: list[str] = field(default_factory=list)  # msg ids of finished work
    purge_queued: bool = False  # a purge of the controller's records is due soon
    template: psutil.Process | None = None  # the warm template engines fork from
    template_env: dict = field(default_factory=dict)  # the environment it started with
    how: str = ""  # how the last engines came up (see launch_note)
    set_id: str = ""  # the ranks' engine set (ipyparallel's), stopped by a hard restart
    standby: Any = None  # engine_sets.Standby: engines forked ahead for the next hard restart


def start_store(s) -> None:
    """Host the TCPStore here. We bind the listening socket ourselves: TCPStore alone
    listens on every interface, whatever host it is given."""
    import socket

    import torch.distributed as dist

    method = s.plan.init_method
    host = method.host if method.kind == "tcp" else s.plan.bind_address
    port = method.port if method.kind == "tcp" else 0
    if not is_loopback(host):  # allowed (ranks elsewhere need it), but never silently
        warnings.warn(
            f"Listening on {host}: the rendezvous TCPStore has no authentication, so "
            "anyone who reaches that address can join or disturb the session. Keep it on "
            "a private network."
            + (
                " ipyparallel's traffic is encrypted (CurveZMQ)."
                if s.plan.bind_address not in LOOPBACK
                else ""
            ),
            stacklevel=2,
        )
    try:
        sock = socket.create_server((host, port), backlog=1024)
        port = sock.getsockname()[1]
        s._store = dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False, master_listen_fd=sock.fileno()
        )
        sock.detach()  # the store owns the descriptor now and closes it
        s._keys = dist.PrefixStore(rank_services.session_root(s._token), s._store)
    except Exception as e:  # port taken, address not ours
        raise DistUsageError(
            f"Cannot host the rendezvous store on {host}:{port} ({e}). "
            "Pick a free port, or use the default env:// init method."
        ) from None


def own_process(s, pid: int) -> psutil.Process | None:
    """The process ``pid`` on this host if it is one of this session's: it carries the
    session's mark (see watchdog.py). The pid an engine on another host reports may name an
    unrelated process here, which must never be signalled."""
    from .watchdog import MARK

    try:
        proc = psutil.Process(pid)
        if proc.environ().get(MARK) == s._profile_dir:
            return proc
    except psutil.Error:  # gone, or another user's: not ours
        pass
    return None


def start_controller(s) -> None:
    import ipyparallel as ipp

    from . import launchers

    s.engines.cluster = ipp.Cluster(
        **launchers.cluster_options(s.plan, s._profile_dir),
        log=logging.getLogger("infini_notebook.ipyparallel"),
        shutdown_atexit=True,
    )
    in_loop(s, s.engines.cluster.start_controller(**launchers.controller_options()))
    s.engines.client = in_loop(s, s.engines.cluster.connect_client())
    # Signatures of received messages, kept against replays: 2**16 by default, ~10 MB
    # after some thousand cells. Messages travel on loopback or CurveZMQ.
    s.engines.client.session.digest_history_size = DIGEST_HISTORY


def ensure_controller(s) -> None:
    """Keep a running controller (a hard restart's new engines register with it); replace
    one that died, its client and connection files first, so nothing of it stays."""
    if controller_running(s):
        return
    stop_controller(s)
    start_controller(s)


def controller_running(s) -> bool:
    """By the process itself: the launcher's state lags a kill (its waiting thread notices
    the exit, then the loop runs the callback), and a restart decided on that state once
    kept a dead controller and then started a second one beside its files."""
    controller = getattr(s.engines.cluster, "controller", None)
    if s.engines.client is None or getattr(controller, "state", None) != "running":
        return False
    try:
        return controller.process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


CONTROLLER_TIMEOUT_S = 10.0  # the longest any single request to the controller may take
CONTROLLER_GONE = (
    "The session's ipyparallel controller is gone (it died or was killed), so nothing "
    "reaches the ranks. Run %dist_restart --hard (variables are lost) or %dist_stop."
)


class ControllerGone(DistUsageError):
    """The controller died: no request to the ranks can be answered."""

    def __init__(self, what: str = ""):
        super().__init__(f"{what}: {CONTROLLER_GONE}" if what else CONTROLLER_GONE)


def require_controller(s, what: str = "") -> None:
    if s.engines.cluster is not None and not controller_running(s):
        raise ControllerGone(what)


def ask_controller(s, msg_type: str, content: dict, timeout: float = CONTROLLER_TIMEOUT_S):
    """One request on the controller's query socket, its reply's content. Sent under the
    client lock, waited for outside it, and never for longer than ``timeout``:
    ipyparallel's own calls (queue_status, purge_results) wait for ever on a dead one."""
    future = send_to_controller(s, msg_type, content)
    try:
        reply = future.result(timeout=timeout)
    except Exception:
        require_controller(s, msg_type)
        raise TimeoutError(f"the controller did not answer {msg_type} in {timeout:.0f}s") from None
    content = reply["content"]
    if content.get("status") != "ok":
        raise RuntimeError(f"the controller refused {msg_type}: {content}")
    return content


def send_to_controller(s, msg_type: str, content: dict):
    """Send one request on the controller's query socket, under the client lock; the
    future of its reply."""
    with s.engines.lock:
        client = s.engines.client
        if client is None:
            raise ControllerGone(msg_type)
        internals.require(client, _QUERY_PARTS, "ipyparallel", "Client: controller requests")
        return client._send(client._query_stream, msg_type, content=content)


def queue_status(s) -> dict[int, dict]:
    """Each engine's queue lengths (``Client.queue_status()``, bounded)."""
    from ipyparallel import util

    content = ask_controller(s, "queue_request", {"targets": None, "verbose": False})
    content.pop("status", None)
    return util.int_keys(content)


def rank_view(s, rank: int):
    """The ipyparallel view of one rank's engine."""
    return s.engines.client[s.engines.eids[rank]]


def ranks_view(s, ranks: list[int]):
    return s.engines.client[[s.engines.eids[r] for r in ranks]]


def in_loop(s, coro, timeout: float = 120):
    """Run an ipyparallel coroutine on this session's own event loop thread. The loop
    keeps running between calls, so the launchers' exit callbacks (which record each
    engine's exit code) fire; ``*_sync`` wrappers would leave them on a stopped loop."""
    import asyncio

    if s.engines.loop is None:
        s.engines.loop = asyncio.new_event_loop()
        threading.Thread(
            target=s.engines.loop.run_forever, name="infini-session-loop", daemon=True
        ).start()
    return asyncio.run_coroutine_threadsafe(coro, s.engines.loop).result(timeout)


def engine_config(s, rank: int) -> dict:
    kernel = psutil.Process()
    method = s.plan.init_method
    address = s.plan.store_address or s._store.host  # never 0.0.0.0: see plan.reachable
    store = {"kind": method.kind, "host": address, "port": s._store.port}
    if method.kind == "file":
        store = {"kind": "file", "path": method.path}
    group_rank, local_rank, local_world = s.plan.placement.rank_places(s.world_size)[rank]
    return {
        "rank": rank,
        "local_rank": local_rank,
        "world_size": s.world_size,
        "local_world_size": local_world,
        "group_rank": group_rank,
        "watch": "store" if s.plan.placement.multi_host else "pid",
        "loopback_only": s.plan.bind_address in LOOPBACK,
        "master_addr": address,
        "master_port": s._store.port,
        "backend": s.plan.backend,
        "timeout": s.plan.timeout,
        "cuda": s.plan.cuda_devices(rank),
        "threads": s.plan.threads_per_rank,
        "store": store,
        "attempt": s.attempt,
        "token": s._token,
        "attempt_key": s._attempt_key,
        "layout": s.plan.layout,
        "kernel_pid": kernel.pid,
        "kernel_start": kernel.create_time(),
        "stack_file": supervision.stack_file(s, rank),
        "workdir": s._workdir,
        # ssh engines write their output there until stop: see remote_folder_removers
        "remove_copy": s.plan.placement.launcher in ("mpi", "slurm"),
    }


def bootstrap_ranks(s, progress: Progress | None = None) -> None:
    configs = {r: engine_config(s, r) for r in range(s.world_size)}
    with s.engines.lock:
        pending = {r: rank_view(s, r).apply_async(bootstrap.bootstrap, configs[r]) for r in configs}
    failed = wait_for_bootstrap(s, pending, progress)
    if failed is not None:  # the others wait for it until the timeout: the caller stops them
        raise bootstrap_error(s, failed, pending[failed])
    infos = gather(s, pending, what="start")
    record_ranks(s, infos)


def wait_for_bootstrap(s, pending: dict, progress: Progress | None) -> int | None:
    """Wait until every rank is set up; the first rank that failed, if one did."""
    deadline = time.monotonic() + s.plan.timeout + 60
    while (done := sum(ar.ready() for ar in pending.values())) < len(pending):
        if progress:
            progress(done, len(pending), "ranks initialised")
        failed = [r for r, ar in pending.items() if ar.ready() and not ar.successful()]
        if failed:
            return failed[0]
        if time.monotonic() > deadline:
            break  # the gather names the ranks that never answered
        time.sleep(0.05)
    if progress:
        progress(done, len(pending), "ranks initialised")
    return next((r for r, ar in pending.items() if not ar.successful()), None)


def bootstrap_error(s, rank: int, ar, lines: int = 20) -> DistCellError:
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
    forget(s, ar.msg_ids)
    return DistCellError(
        f"Starting {s.world_size} ranks failed on rank {rank}: {one_line(error)}. "
        f"The other ranks were stopped. {start_advice(s.plan)}",
        report,
        [rank],
    )


def host_name(s, rank: int, reported: str) -> str:
    """The host as the user named it in --hosts (two hosts may share a hostname)."""
    place = s.plan.placement
    if not place.multi_host or place.launcher == "slurm":  # Slurm picks the nodes
        return reported
    return place.hosts[place.rank_places(s.world_size)[rank][0]][0]


def record_ranks(s, infos: dict[int, dict]) -> None:
    layout = s.layout
    s.ranks = []
    for r in range(s.world_size):
        info = infos[r]
        proc = own_process(s, info["pid"])  # a remote pid means nothing here (see liveness)
        if proc is not None:
            s.engines.pids[r] = proc
        s.ranks.append(
            RankState(
                rank=r,
                pid=info["pid"],
                host=host_name(s, r, info["host"]),
                device=info["device"],
                device_name=info["device_name"],
                memory_used=info["memory_used"],
                state="idle",
                coords=layout.coords(r),
            )
        )


def remote_folder_removers(s) -> list:
    """The ssh connections (one per host) of ssh engines, to remove the session's folder
    that ipyparallel made on their hosts (profile, connection file, output), once it has
    fetched their output at stop. Taken before the engines stop: their launchers go."""
    senders = {}
    for engine_set in (s.engines.cluster.engines if s.engines.cluster else {}).values():
        for launcher in getattr(engine_set, "launchers", {}).values():
            if hasattr(launcher, "ssh_sender") and hasattr(launcher, "location"):
                senders.setdefault(launcher.location, launcher)
    return list(senders.values())


def remove_remote_folders(s, launchers: list, timeout: float = 10) -> None:
    """Remove the session's folder on each ssh host (see remote_folder_removers); only a
    folder named as the session's, and not waiting more than ``timeout`` for a host."""
    from .watchdog import FOLDER_PREFIX

    folder = os.path.dirname(s._profile_dir)
    if not launchers or not os.path.basename(folder).startswith(FOLDER_PREFIX):
        return

    def remove(launcher) -> None:
        try:
            launcher.ssh_sender.cmd_rmdir(os.path.dirname(launcher.remote_profile_dir))
        except Exception as e:
            log.info("removing the session folder on %s: %s", launcher.location, e)

    threads = [threading.Thread(target=remove, args=(x,), daemon=True) for x in launchers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)


def close_client(s) -> None:
    with s.engines.lock:
        if s.engines.client is not None:
            try:
                s.engines.client.close()
            except Exception:
                pass
            s.engines.client = None
        s.engines.unpurged = []


def stop_controller(s) -> None:
    """The controller, running or dead, and its connection files (a controller that died
    leaves them; a new one must not meet them). Engines first: see stop_processes."""
    close_client(s)
    if s.engines.cluster is None:
        return
    try:
        in_loop(s, s.engines.cluster.stop_controller())
    except Exception as e:
        log.warning("stopping the controller: %s", e)
    security = os.path.join(s._profile_dir, "security")
    for path in glob.glob(os.path.join(security, f"ipcontroller-{s.engines.cluster.cluster_id}-*")):
        remove_quietly(path)
    s.engines.cluster = None


def start_advice(plan: SessionPlan) -> str:
    """What to check when engines cannot start, for where they run."""
    if plan.placement.remote:
        return (
            "Check that the hosts are reachable and run the same Python with "
            "infini_notebook installed."
        )
    return (
        f"The engines run {sys.executable} on this machine: check that it imports "
        "ipyparallel, torch and infini_notebook, and your --env values."
    )


def remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def gather(s, pending: dict, what: str, timeout: float | None = None) -> dict:
    """Wait for one apply per rank; raise DistCellError naming the ranks that failed."""
    deadline = time.monotonic() + (timeout or s.plan.timeout + 60)
    out, errors, tracebacks = {}, {}, {}
    for r, ar in pending.items():
        while not ar.ready() and time.monotonic() < deadline:  # a dead controller never answers
            ar.wait(min(1.0, max(0.0, deadline - time.monotonic())))
            if not ar.ready() and not controller_running(s):
                raise DistCellError(f"{what}: {CONTROLLER_GONE}")
        try:
            out[r] = ar.get(timeout=0)
        except Exception as e:
            errors[r] = one_line(e)
            tracebacks[r] = remote_traceback(e)
    # return values can be big (a pulled tensor): nothing here keeps a copy
    forget(s, [m for ar in pending.values() for m in ar.msg_ids])
    if errors:
        raise DistCellError(
            f"{what} failed on {error_summary(errors, list(pending))}",
            error_report(tracebacks),
            sorted(errors),
        )
    return out


def forget(s, msg_ids: list[str]) -> None:
    """Drop what ipyparallel keeps of finished work: the client's results, metadata and
    history now, the controller's records soon after (see ``purge_hub``). Work still
    running (a rank that ignored an interrupt) is dropped once it ends."""
    with s.engines.lock:
        client = s.engines.client
        if client is None:
            return
        s.engines.unpurged.extend(msg_ids)
        outstanding = client.outstanding  # a traitlet: slow to read once per message
        done = {m for m in s.engines.unpurged if m not in outstanding}
        s.engines.unpurged = [m for m in s.engines.unpurged if m not in done]
        if done:  # an empty list is refused by ipyparallel
            client.purge_local_results(jobs=list(done))
        client.history = [m for m in client.history if m not in done]
        if s.engines.purge_queued or s.engines.loop is None:
            return
        s.engines.purge_queued = True
    s.engines.loop.call_soon_threadsafe(s.engines.loop.call_later, HUB_PURGE_DELAY_S, purge_hub, s)


def purge_hub(s) -> None:
    """Ask the controller to drop every finished task's record (results included, such
    as a pulled tensor). On the session's loop thread, at most once per
    HUB_PURGE_DELAY_S: a round trip costs about as much as an empty cell's tenth, and
    the controller counts a task finished a little after the client does. Not waited
    for: the loop also stops engines, and a controller that died would have held a hard
    restart for the whole CONTROLLER_TIMEOUT_S."""
    s.engines.purge_queued = False
    if not controller_running(s):
        return
    try:
        future = send_to_controller(s, "purge_request", {"engine_ids": [], "msg_ids": "all"})
    except Exception as e:
        log.debug("controller purge: %s", e)
        return
    future.add_done_callback(_log_purge_reply)


def _log_purge_reply(future) -> None:
    try:
        status = future.result()["content"].get("status")
    except Exception as e:
        status = one_line(e)
    if status != "ok":
        log.debug("controller purge: %s", status)
