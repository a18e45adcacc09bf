"""What runs inside each engine (one process per rank): bootstrap, namespace, stack dumps,
parent watch. The kernel calls these functions through ipyparallel's ``apply``.

Importing this module must stay cheap and torch-free: ipyparallel unpickles functions by
module reference, and the environment (CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS) has to be set
before torch is first imported on the engine.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import threading
import time
from datetime import timedelta
from typing import Any

# Per-engine state that outlives one process group: the base store is reused across soft
# restarts (each attempt gets its own PrefixStore), the stack file stays open for faulthandler.
_STATE: dict[str, Any] = {}

TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def user_namespace() -> dict:
    """The namespace ``%%dist`` cells run in (the engine's IPython shell)."""
    from IPython import get_ipython

    return get_ipython().user_ns


def bootstrap(cfg: dict) -> dict:
    """Set up this rank: environment, device, process group, parallel groups, namespace.

    ``cfg`` comes from the kernel (see ``cluster.Session._engine_config``)."""
    _set_environment(cfg)
    if cfg.get("watch", "pid") == "pid":
        _watch_parent(cfg["kernel_pid"], cfg["kernel_start"])
    else:  # the kernel is on another host: its store going away is the signal
        _watch_store(cfg["master_addr"], cfg["master_port"])
    _install_stack_dumper(cfg["stack_file"])
    _keep_no_output_history()
    import torch

    torch.set_num_threads(cfg["threads"])
    if cfg.get("gpu") is not None:
        torch.cuda.set_device(0)  # the only GPU this engine sees
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
    env = {
        "RANK": cfg["rank"],
        "LOCAL_RANK": cfg["local_rank"],
        "WORLD_SIZE": cfg["world_size"],
        "LOCAL_WORLD_SIZE": cfg["local_world_size"],
        "GROUP_RANK": cfg["group_rank"],
        "MASTER_ADDR": cfg["master_addr"],
        "MASTER_PORT": cfg["master_port"],
        "OMP_NUM_THREADS": cfg["threads"],
    }
    if cfg.get("gpu") is not None:
        env["CUDA_VISIBLE_DEVICES"] = cfg["gpu"]
    if cfg.get("loopback_only") and "GLOO_SOCKET_IFNAME" not in os.environ:
        iface = _loopback_interface()
        if iface:  # gloo listens where the hostname resolves, maybe a public address
            env["GLOO_SOCKET_IFNAME"] = iface
    for key, value in env.items():
        os.environ[key] = str(value)
    _STATE["cfg"] = cfg


def _loopback_interface() -> str | None:
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addrs):
            return name
    return None


def _device(torch, cfg: dict):
    return torch.device("cuda", 0) if cfg.get("gpu") is not None else torch.device("cpu")


def init_distributed(cfg: dict) -> None:
    """(Re)create the default process group and the parallel groups under a fresh prefix,
    then put the usual names into the user's namespace. Called again by a soft restart."""
    import torch
    import torch.distributed as dist

    from .groups import ParallelLayout, init_parallel_groups

    device = _device(torch, cfg)
    timeout = timedelta(seconds=cfg["timeout"])
    store = dist.PrefixStore(f"attempt_{cfg['attempt']}", _base_store(cfg, timeout))
    dist.init_process_group(
        cfg["backend"],
        store=store,
        rank=cfg["rank"],
        world_size=cfg["world_size"],
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    layout = ParallelLayout(**cfg["layout"])
    groups = init_parallel_groups(layout)
    ns = user_namespace()
    ns.update(
        torch=torch,
        dist=dist,
        rank=cfg["rank"],
        world_size=cfg["world_size"],
        local_rank=cfg["local_rank"],
        device=device,
        groups=groups,
        mesh=groups.mesh,
        layout=layout,
    )
    _STATE["groups"] = groups


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
    if groups is not None and hasattr(groups, "destroy"):
        groups.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()
    return True


def reinit_distributed(attempt: int) -> dict:
    cfg = dict(_STATE["cfg"], attempt=attempt)
    _STATE["cfg"] = cfg
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
    }
    if device is not None and getattr(device, "type", "") == "cuda":
        import torch

        info["device_name"] = torch.cuda.get_device_name(device)
        info["memory_used"] = torch.cuda.memory_allocated(device)
    return info


def pull_value(name: str) -> Any:
    """A namespace value for the kernel, with tensors moved to CPU."""
    ns = user_namespace()
    if name not in ns:
        raise NameError(f"name {name!r} is not defined on this rank")
    return _to_cpu(ns[name])


def _to_cpu(value: Any) -> Any:
    try:
        import torch
    except ImportError:
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def push_values(values: dict) -> None:
    user_namespace().update(values)


def _install_stack_dumper(path: str) -> None:
    """SIGUSR1 writes every thread's Python stack to ``path``. faulthandler does it from the
    C signal handler, so it works while the rank is stuck in a collective."""
    f = open(path, "w")  # kept open for the process's life
    _STATE["stack_file"] = f
    faulthandler.register(signal.SIGUSR1, file=f, all_threads=True, chain=False)


def identity() -> dict:
    """What the kernel needs to map this engine to a global rank (see launchers.assign_ranks)."""
    env = os.environ
    launcher_rank = next(
        (env[k] for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID") if k in env), None
    )
    return {
        "launcher_rank": launcher_rank,
        "host_index": env.get("INFINI_HOST_INDEX"),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
    }


def _watch_store(host: str, port: int) -> None:
    """Exit when the kernel's TCPStore stops answering (three misses in a row)."""

    def watch() -> None:
        import torch.distributed as dist

        misses = 0
        try:
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5))
        except Exception:
            os._exit(3)
        while misses < 3:
            time.sleep(1.0)
            try:
                store.check(["infini/alive"])
                misses = 0
            except Exception:
                misses += 1
        os._exit(3)

    threading.Thread(target=watch, name="infini-store-watch", daemon=True).start()


def _watch_parent(kernel_pid: int, kernel_start: float) -> None:
    """Exit when the notebook kernel is gone (even after SIGKILL): ipyparallel alone would
    leave engines running for minutes."""

    def alive() -> bool:
        try:
            import psutil

            return abs(psutil.Process(kernel_pid).create_time() - kernel_start) < 1.0
        except Exception:
            return False

    def watch() -> None:
        while alive():
            time.sleep(1.0)
        os._exit(3)

    threading.Thread(target=watch, name="infini-parent-watch", daemon=True).start()
