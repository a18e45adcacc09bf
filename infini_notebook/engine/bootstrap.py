"""What runs inside each engine (one process per rank) at bootstrap and on the kernel's
``apply``: environment, device, process group and namespace, soft restarts, pull/push,
identity. The threads an engine runs beside cells are in ``rank_services``, post-mortem in
``postmortem``, the namespace itself (also under torchrun) in ``torchrun``.

Importing this module must stay cheap and torch-free: ipyparallel unpickles functions by
module reference, and the environment (CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS) has to be set
before torch is first imported on the engine.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

from . import (
    cell_end,
    cell_names,
    output_streams,
    rank_services,
    relay_port,
    remote_start,
    stdin_relay,
    threads,
    tuning,
    wait_probe,
    widget_labels,
)
from .postmortem import failing_frame, post_mortem, remember_failures, run_in_frame
from .rank_services import (
    STACK_SIGNAL,
    TELEMETRY_FIELDS,
    TELEMETRY_INTERVAL_S,
    as_seen_by_thread,
    parse_telemetry,
    session_root,
    stack_key,
    telemetry_key,
)
from .torchrun import LabeledStream, label_streams, rank_namespace, torchrun_namespace

# Names the kernel, tests and exported scripts reach through this module.
__all__ = [
    "STACK_SIGNAL",
    "TELEMETRY_FIELDS",
    "TELEMETRY_INTERVAL_S",
    "LabeledStream",
    "as_seen_by_thread",
    "failing_frame",
    "label_streams",
    "parse_telemetry",
    "post_mortem",
    "rank_namespace",
    "run_in_frame",
    "session_root",
    "stack_key",
    "telemetry_key",
    "torchrun_namespace",
]

# Per-engine state that outlives one process group: the base store is reused across soft
# restarts (each attempt gets its own PrefixStore).
_STATE: dict[str, Any] = {}


def user_namespace() -> dict:
    """The namespace ``%%dist`` cells run in (the engine's IPython shell)."""
    from IPython import get_ipython

    return get_ipython().user_ns


def bootstrap(cfg: dict) -> dict:
    """Set up this rank: environment, device, process group, parallel groups, namespace.

    ``cfg`` comes from the kernel (see ``launch.startup.engine_config``)."""
    cfg = dict(cfg, threads=threads.per_rank(cfg))
    remote_start.remove_own_folder()  # an engine on another host: see remote_start
    _set_environment(cfg)
    rank_services.start(cfg)  # parent/store watcher, stack answerer
    remember_failures()
    _keep_no_output_history()
    tuning.apply()
    from IPython import get_ipython

    output_streams.install(get_ipython())
    cell_names.install(get_ipython())
    cell_end.install(get_ipython())
    widget_labels.install(get_ipython())
    stdin_relay.install(getattr(get_ipython(), "kernel", None), cfg)
    if cfg.get("relay"):  # --relay: cells come from this host's relay (relay_port.py)
        relay_port.connect(*cfg["relay"], cfg["rank"])
    import torch

    threads.apply(cfg["threads"])
    _install_env_rendezvous()
    if cfg.get("cuda") is not None:
        torch.cuda.set_device(_device(torch, cfg))  # cuda:LOCAL_RANK, as torchrun code expects
        if cfg.get("memory_fraction"):  # --gpu-memory-fraction: ranks sharing a GPU
            torch.cuda.set_per_process_memory_fraction(cfg["memory_fraction"], _device(torch, cfg))
    rank_services.install_telemetry(cfg)
    init_distributed(cfg)
    return describe_rank(user_namespace()["device"])


def _keep_no_output_history() -> None:
    """A cell's last value goes to the kernel (``session.last``) and nowhere else on the
    rank: IPython's output cache (Out, _, __, ___, _N) would keep every one alive, GPU
    tensors included, for as long as the engine runs."""
    from IPython import get_ipython

    shell = get_ipython()
    shell.displayhook.cache_size = 0  # what IPython does for InteractiveShell.cache_size=0
    shell.displayhook.do_full_cache = 0
    shell.events.register("post_run_cell", _drop_logged_outputs)


def _drop_logged_outputs(result=None) -> None:
    """IPython's history also logs each cell's formatted outputs and tracebacks; drop them
    after the cell."""
    from IPython import get_ipython

    history = get_ipython().history_manager
    for name in ("outputs", "output_hist_reprs", "exceptions"):
        logged = getattr(history, name, None)
        if logged is not None:
            logged.clear()


def _set_environment(cfg: dict) -> None:
    cuda = cfg.get("cuda")
    if cuda is not None and cuda[0] is None:  # the host's launcher chose our GPUs
        from ..core.plan import launcher_device

        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        cfg["cuda"] = (None, launcher_device(visible, cfg["local_rank"], cfg["local_world_size"]))
    env = engine_environment(cfg)
    iface = _loopback_interface() if cfg.get("loopback_only") else None
    env.update(backend_defaults(os.environ, iface))
    env.update(sharing_environment(cfg, os.environ))
    from importlib.metadata import version  # torch is not imported yet: it reads these then

    for key, value in wait_probe.flight_recorder_env(version("torch")).items():
        env.setdefault(key, os.environ.get(key, value))  # a user's own setting stays
    os.environ.update(env)
    _STATE["cfg"] = cfg
    rank_services.follow_attempt(cfg["attempt"])


# TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (CleanUpOnly): a failed or timed-out NCCL collective
# aborts its communicators and raises in the rank, which lives on. torch's default (3)
# tears the process down, so a soft restart would find it dead.
NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


def backend_defaults(environ, loopback_iface: str | None) -> dict[str, str]:
    """gloo's and NCCL's settings that a rank gets unless the user set them (in --env or
    the kernel's environment). On a loopback-only session both backends listen on the
    loopback interface: by default they listen where the hostname resolves, maybe a
    public address. Pure."""
    wanted = dict([NCCL_ERROR_HANDLING])
    if loopback_iface:
        wanted.update(GLOO_SOCKET_IFNAME=loopback_iface, NCCL_SOCKET_IFNAME=loopback_iface)
    return {k: v for k, v in wanted.items() if k not in environ}


def sharing_environment(cfg: dict, environ) -> dict[str, str]:
    """NCCL's settings for ranks that share a GPU (core/devices.sharing_env), set before the
    first communicator; a user's own setting (--env, the kernel's environment) stays, except
    that a host id the user set gets our per-slot suffix: one id for every rank would make
    NCCL refuse the ranks sharing the GPU. Pure."""
    env = {}
    for key, value in cfg.get("nccl_sharing", {}).items():
        if key == "NCCL_HOSTID" and environ.get(key):
            env[key] = f"{environ[key]}-{value}"
        elif key not in environ:
            env[key] = value
    return env


def engine_environment(cfg: dict) -> dict[str, str]:
    """The variables a rank gets: torchrun's, the layout's (what ``init_parallel_groups()``
    reads) and the visible GPUs. Pure, from the kernel's ``cfg``."""
    from ..core.layout import ParallelLayout

    env = {
        "RANK": cfg["rank"],
        "LOCAL_RANK": cfg["local_rank"],
        "WORLD_SIZE": cfg["world_size"],
        "LOCAL_WORLD_SIZE": cfg["local_world_size"],
        "GROUP_RANK": cfg["group_rank"],
        "MASTER_ADDR": cfg["master_addr"],
        "MASTER_PORT": cfg["master_port"],
        # The kernel hosts the store on MASTER_PORT, as torchrun's agent does: a user's own
        # init_process_group("env://") then connects to it instead of trying to host one there.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": cfg["attempt"],
        "OMP_NUM_THREADS": cfg["threads"],  # for libraries loaded later, and child processes
        "MKL_NUM_THREADS": cfg["threads"],
        "OPENBLAS_NUM_THREADS": cfg["threads"],
        **ParallelLayout(**cfg["layout"]).to_env(),
    }
    if cfg.get("cuda") is not None and cfg["cuda"][0] is not None:
        env["CUDA_VISIBLE_DEVICES"] = cfg["cuda"][0]
    return {key: str(value) for key, value in env.items()}


def _loopback_interface() -> str | None:
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addrs):
            return name
    return None


def _device(torch, cfg: dict):
    cuda = cfg.get("cuda")
    return torch.device("cuda", cuda[1]) if cuda is not None else torch.device("cpu")


def init_distributed(cfg: dict) -> None:
    """(Re)create the default process group and the parallel groups under a fresh prefix,
    then put the usual names into the user's namespace. Called again by a soft restart."""
    import torch
    import torch.distributed as dist

    from ..core.layout import ParallelLayout

    device = _device(torch, cfg)
    timeout = timedelta(seconds=cfg["timeout"])
    store = dist.PrefixStore(attempt_prefix(cfg), _base_store(cfg, timeout))
    # A group bound to its device inits NCCL at once and lets groups.py split communicators
    # from it. Not in a process that aborted communicators: there split_group segfaulted
    # (torch 2.11, NCCL 2.28.9, H100, 2026-11-26: faulthandler in dist.split_group on every
    # rank of the rebuild; the same rebuild without splits ran, scripts/nccl_release_probe.py),
    # so the rebuilt groups init lazily, each its own communicator (docs/gpu.md).
    bind = binds_device(device.type, cfg, wait_probe.aborted_before())
    dist.init_process_group(
        cfg["backend"],
        store=store,
        rank=cfg["rank"],
        world_size=cfg["world_size"],
        timeout=timeout,
        device_id=device if bind else None,
    )
    ns = user_namespace()
    layout = ParallelLayout(**cfg["layout"])
    ns.update(rank_namespace(layout, device, cfg["local_rank"], timeout=timeout))
    _STATE["groups"] = ns["groups"]


def binds_device(device_type: str, cfg: dict, aborted: bool) -> bool:
    """Whether this rank's default group binds its device (see init_distributed). Every rank
    must decide alike: a bound rank splits its groups from the world's communicator, an
    unbound one makes each anew, and mixed they wait on each other for ever (H100, 2026-11-28:
    a rank replaced after an abort bound its device and hung the rebuild). A rank that
    replaces one among ranks that aborted is told not to (recovery.replace_ranks); at a
    rebuild the kernel asks every rank (``can_bind``) and tells all of them one answer
    (``reinit_distributed``'s ``bind``), kept through later rebuilds (``_STATE["cfg"]``)."""
    return device_type == "cuda" and cfg.get("bind_device", True) and not aborted


def can_bind() -> bool:
    """This rank's vote for the next rebuild (recovery.bind_decision): no once it aborted
    communicators (a release on NCCL) or was told not to bind."""
    return bool(_STATE["cfg"].get("bind_device", True)) and not wait_probe.aborted_before()


def attempt_prefix(cfg: dict, what: str = "") -> str:
    """Where an attempt's process groups (or, with ``what``, a user's own inits) keep their
    keys: under the session's root and this attempt's nonce, so no one who has not seen the
    attempt begin can know them."""
    root = session_root(cfg["token"])
    return f"{root}/{what}attempt_{cfg['attempt']}-{cfg['attempt_key']}"


def _install_env_rendezvous() -> None:
    """A user's own ``init_process_group("env://")`` in a cell gets fresh store keys each time.

    With TORCHELASTIC_USE_AGENT_STORE torch uses the kernel's store with bare keys, so a second
    destroy and re-init (in one cell, or after a %dist_restart) would read the first one's
    stale gloo/nccl addresses and hang. Prefixing each init by (attempt, count) keeps ranks in
    step: every rank re-inits the same number of times, and a restart starts the count over.
    torch has no public way to replace a scheme's handler, hence its registry."""
    import importlib

    from torch.distributed import PrefixStore

    rdzv = importlib.import_module("torch.distributed.rendezvous")  # the name is a function too
    torch_env = rdzv._rendezvous_handlers.get("env")
    if torch_env is None or getattr(torch_env, "_infini", False):
        return

    def env_handler(url: str, **kwargs):
        store, rank, world_size = next(torch_env(url, **kwargs))
        cfg = _STATE["cfg"]
        counts = _STATE.setdefault("user_inits", {})
        counts[cfg["attempt"]] = n = counts.get(cfg["attempt"], 0) + 1
        yield PrefixStore(f"{attempt_prefix(cfg, 'user/')}/init_{n}", store), rank, world_size
        raise RuntimeError("Unable to perform re-rendezvous using env:// method")

    env_handler._infini = True
    rdzv._rendezvous_handlers["env"] = env_handler


def _base_store(cfg: dict, timeout: timedelta):
    """The store every attempt shares: a client of the kernel's TCPStore, or a FileStore."""
    import torch.distributed as dist

    if "store" in _STATE:
        return _STATE["store"]
    spec = cfg["store"]
    if spec["kind"] == "file":
        store = dist.FileStore(spec["path"], cfg["world_size"])
    else:
        # env:// reads the address from the environment, as torch's env rendezvous does.
        host = os.environ["MASTER_ADDR"] if spec["kind"] == "env" else spec["host"]
        port = int(os.environ["MASTER_PORT"]) if spec["kind"] == "env" else spec["port"]
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
    _STATE["store"] = store
    return store


def teardown_distributed() -> bool:
    """Destroy the process groups (before a soft restart). Returns True when done."""
    import torch.distributed as dist

    groups = _STATE.pop("groups", None)
    try:  # groups aborted on a release (NCCL) may be gone already
        if groups is not None and hasattr(groups, "destroy"):
            groups.destroy()
    except Exception:
        pass
    if dist.is_initialized():
        dist.destroy_process_group()
    return True


def release_groups(peer_links: list[list] | None = None) -> str:
    """End this rank's part in its process groups, so that peers blocked on it are
    released. NCCL: abort the communicators (a destroy could wait for the very work that
    hangs). gloo: destroy the groups, and shut down this process's connections to the
    waiting peers (``peer_links``, see wait_probe.close_peer_links). The kernel rebuilds the
    groups afterwards (a soft restart)."""
    import torch.distributed as dist

    if dist.is_initialized() and "nccl" in str(dist.get_backend()):
        wait_probe.abort_groups()
        destroy_aborted()
        return "aborted"
    teardown_distributed()
    closed = wait_probe.close_peer_links(peer_links)
    return f"destroyed; {closed} connections to waiting ranks closed"


def destroy_aborted() -> None:
    """After an abort, destroy what is left of the groups, so that their communicators and
    buffers go now, not at the next rebuild. ``_abort_process_group()`` has already taken
    the default group out of c10d's world (``_abort_process_group`` in
    torch/distributed/distributed_c10d.py), so only the layout's groups remain here."""
    import torch.distributed as dist

    groups = _STATE.pop("groups", None)
    try:
        if groups is not None and hasattr(groups, "destroy"):
            groups.destroy()
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # already gone with the abort
        pass


def reinit_distributed(attempt: int, attempt_key: str, peer_lost: bool, bind: bool) -> dict:
    """New process groups under ``attempt``. ``peer_lost``: a rank is being replaced; its
    NCCL communicators are aborted, not destroyed (a destroy may wait on the dead peer).
    ``bind``: the kernel's one answer for every rank (recovery.bind_decision).

    Not ``dist.shrink_group`` (torch 2.13, distributed_c10d.py ``shrink_group``): it returns
    a *smaller* group of the ranks that stay, renumbered, and shrinking the default group
    destroys every other group; torch 2.13 binds no grow (``ncclCommGrow``) to bring a new
    rank in. A replaced rank keeps its number and the layout its size, so the communicators
    are made anew (issue 51)."""
    cfg = dict(_STATE["cfg"], attempt=attempt, attempt_key=attempt_key, bind_device=bind)
    _set_environment(cfg)  # TORCHELASTIC_RESTART_COUNT follows the attempt
    import torch.distributed as dist

    if peer_lost and dist.is_initialized() and "nccl" in str(dist.get_backend()):
        wait_probe.abort_groups()
        destroy_aborted()
    teardown_distributed()
    init_distributed(cfg)
    return describe_rank(user_namespace()["device"])


def describe_rank(device=None) -> dict:
    """Static facts for the status display."""
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "device": str(device) if device is not None else "cpu",
        "device_name": "cpu",
        "memory_used": None,
        "threads": threads.torch_threads(),
    }
    if device is not None and getattr(device, "type", "") == "cuda":
        import torch

        info["device_name"] = torch.cuda.get_device_name(device)
        # the device's memory in use, every process's, as telemetry reports it (RankState)
        free, total = torch.cuda.mem_get_info(device)
        info["memory_used"] = total - free
    return rank_services.remember(info)


def identity() -> dict:
    """What the kernel needs to map this engine to a global rank (see launchers.assign_ranks)."""
    env = os.environ
    launcher_rank = next(
        (env[k] for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID") if k in env), None
    )
    local_rank = next(
        (
            env[k]
            for k in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")
            if k in env
        ),
        None,
    )
    return {
        "launcher_rank": launcher_rank,
        "launcher_local_rank": local_rank,
        "host_index": env.get("INFINI_HOST_INDEX"),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
    }
