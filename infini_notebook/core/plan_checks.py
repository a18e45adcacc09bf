"""Validate ``%dist_start`` options into a :class:`SessionPlan` (plan.py) before any
process starts: every refusal names the fix. Pure.

Nothing here imports torch or ipyparallel: the caller passes in what it detected (how many
GPUs are visible), so every refusal is unit-testable in milliseconds.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from urllib.parse import urlparse

from .devices import check_sharing_nccl, choose_devices, remote_gpu_count
from .errors import DistUsageError
from .keep import check_name, parse_duration
from .options import StartOptions
from .plan import LOOPBACK, InitMethod, Placement, SessionPlan, is_loopback

BACKENDS = ("auto", "nccl", "gloo")
LAUNCHERS = ("local", "ssh", "mpi", "slurm")


def parse_init_method(text: str | None, bind_address: str = "127.0.0.1") -> InitMethod:
    """``env://`` (default), ``tcp://HOST:PORT`` or ``file:///ABS/PATH``."""
    if not text or text == "env://":
        return InitMethod("env", host=bind_address)
    url = urlparse(text)
    if url.scheme == "tcp":
        try:
            port = url.port
        except ValueError:  # urllib: not a number, or not in 0-65535
            raise DistUsageError(
                f"--init-method {text!r}: the port must be a number from 1 to 65535, "
                "like tcp://127.0.0.1:29500."
            ) from None
        if not url.hostname or port is None:
            raise DistUsageError(
                f"--init-method {text!r} needs a host and a port, like tcp://127.0.0.1:29500."
            )
        return InitMethod("tcp", host=url.hostname, port=port)
    if url.scheme == "file":
        path = url.path
        if not path.startswith("/") or url.netloc:
            raise DistUsageError(
                f"--init-method {text!r} needs an absolute path after file://, "
                "like file:///tmp/dist_init (three slashes)."
            )
        parent = os.path.dirname(path) or "/"
        if not os.path.isdir(parent):
            raise DistUsageError(
                f"--init-method {text!r}: folder {parent!r} does not exist; create it first."
            )
        return InitMethod("file", path=path)
    raise DistUsageError(
        f"Unknown --init-method {text!r}: use env:// (default), tcp://HOST:PORT or "
        "file:///PATH, as torch.distributed does."
    )


def make_plan(
    options: StartOptions | None = None,
    *,
    visible_gpus: list[str] | None = None,
    host_addresses: list[str] | None = None,
    nccl_version: tuple[int, ...] | None = None,
    layout: dict | None = None,
    **keywords,
) -> SessionPlan:
    """Check every option against what this machine has; raise DistUsageError on the first
    problem with a message that names the fix. Without ``options``, the keywords (and
    ``layout``) fill a StartOptions. ``host_addresses``: this machine's IP addresses;
    ``nccl_version``: the NCCL torch loads here, for ranks that share a GPU."""
    if options is None:
        options = StartOptions(**keywords, **(layout or {}))
    plan = _make_plan(options, visible_gpus)
    check_sharing_nccl(plan.gpus, plan.backend, nccl_version)
    plan = replace(
        plan,
        nccl_version=nccl_version,
        gpu_memory_fraction=_memory_fraction(options, plan),
    )
    plan = replace(plan, template_off=template_off(options, plan))
    plan = replace(plan, **keep_fields(options, plan))
    plan = replace(plan, relay=relay_field(options, plan))
    return with_addresses(plan, host_addresses or [])


def keep_fields(o: StartOptions, plan: SessionPlan) -> dict:
    """--name and --keep, checked: both or neither, local ranks, a store of our own."""
    if o.name is None and o.keep is None:
        return {}
    if o.name is None or o.keep is None:
        raise DistUsageError(
            "--keep and --name go together: --name NAME --keep 30m keeps the session when "
            "the kernel dies, for %dist_attach NAME."
        )
    if plan.placement.launcher != "local" or plan.init_method.kind == "file":
        raise DistUsageError(
            "--keep works with ranks on this machine (the local launcher) and the env:// or "
            "tcp:// init method."
        )
    return {"name": check_name(o.name), "keep_s": parse_duration(o.keep)}


def relay_field(o: StartOptions, plan: SessionPlan) -> bool:
    """--relay, checked: a relay runs on each host the kernel starts ranks on itself (this
    machine, or over ssh), not where mpiexec or Slurm place them; a kept session's
    detached cells keep their output in the controller's records, which a relayed cell
    never reaches (docs/scale.md, what is left)."""
    if not o.relay:
        return False
    if plan.placement.launcher not in ("local", "ssh"):
        raise DistUsageError(
            f"--relay starts a relay on each host of ranks, on this machine or over ssh: "
            f"the hosts of the {plan.placement.launcher} launcher are not known to the kernel. "
            "Leave --relay out, or start the ranks with --launcher ssh --hosts on the "
            "allocation's hosts."
        )
    if plan.keep_s:
        raise DistUsageError(
            "--relay does not work with --keep yet: a detached cell's output would be lost. "
            "Leave one of them out."
        )
    return True


def template_off(o: StartOptions, plan: SessionPlan, platform: str | None = None) -> str:
    """Why this plan's engines cannot be forked from a warm template, "" when they can:
    only the local launcher starts engines on this host, and only Linux forks a process
    that has imported torch safely (macOS's system libraries are not fork-safe)."""
    if o.no_template:
        return "--no-template"
    if plan.placement.launcher != "local":
        return f"the {plan.placement.launcher} launcher starts the engines"
    if (platform or sys.platform) != "linux":
        return f"no safe fork on {platform or sys.platform}"
    return ""


WILDCARDS = ("0.0.0.0", "::")


def with_addresses(plan: SessionPlan, host_addresses: list[str]) -> SessionPlan:
    """The plan with the addresses ranks connect to (see ``reachable``)."""
    method = plan.init_method
    store_host = method.host if method.kind == "tcp" else plan.bind_address
    return replace(
        plan,
        controller_address=reachable(plan, plan.bind_address, host_addresses, "--bind-address"),
        store_address=reachable(plan, store_host, host_addresses, "the host of --init-method"),
    )


def reachable(plan: SessionPlan, host: str, host_addresses: list[str], flag: str) -> str:
    """The address ranks connect to for a socket listening on ``host``. 0.0.0.0 listens on
    every interface but is no address to connect to: ranks on this host use loopback,
    ranks elsewhere the bind address, or this host's one routable address."""
    if host not in WILDCARDS:
        return host
    if not plan.placement.remote:
        return "127.0.0.1"
    if plan.bind_address not in WILDCARDS and not is_loopback(plan.bind_address):
        return plan.bind_address
    routable = [a for a in host_addresses if not is_loopback(a) and a not in WILDCARDS]
    if len(routable) == 1:
        return routable[0]
    raise DistUsageError(
        f"{flag} {host} listens on every interface, but ranks on other hosts need one "
        f"address of this machine to connect to, and it has "
        + (f"several: {', '.join(routable)}." if routable else "none but loopback.")
        + " Pass --bind-address with the one those hosts reach"
        + (" (and --init-method tcp://THAT_ADDRESS:PORT)." if flag != "--bind-address" else ".")
    )


def _make_plan(options: StartOptions, visible_gpus: list[str] | None) -> SessionPlan:
    o = options
    if o.backend not in BACKENDS:
        raise DistUsageError(
            f"Unknown --backend {o.backend!r}: choose one of {', '.join(BACKENDS)}."
        )
    if o.timeout is None or o.timeout <= 0:
        raise DistUsageError(f"--timeout must be a positive number of seconds, got {o.timeout}.")
    if o.launcher not in LAUNCHERS:
        raise DistUsageError(
            f"Unknown --launcher {o.launcher!r}: choose one of {', '.join(LAUNCHERS)}."
        )
    if o.launcher != "local" or o.hosts:
        return _remote_plan(o)
    backend, bind_address = o.backend, o.bind_address
    gpus, world = choose_devices(o.gpus, o.nprocs, backend, list(visible_gpus or []))
    on_gpu = bool(gpus)
    if backend == "auto":
        backend = "nccl" if on_gpu else "gloo"
    if backend == "nccl" and not on_gpu:
        raise DistUsageError(
            "--backend nccl needs GPUs, and this session has CPU ranks. Use --backend gloo "
            "(the default for --nprocs) or start with --gpus N on a machine with CUDA."
        )
    method = parse_init_method(o.init_method, bind_address)
    layout_dict = _check_layout(world, o.layout)
    return SessionPlan(
        world_size=world,
        backend=backend,
        gpus=gpus,
        timeout=float(o.timeout),
        init_method=method,
        layout=layout_dict,
        threads=_threads(o),
        bind_address=bind_address,
        placement=Placement(env=parse_env(o.env)),
    )


def _memory_fraction(o: StartOptions, plan: SessionPlan) -> float | None:
    f = o.gpu_memory_fraction
    if f is None:
        return None
    if not plan.gpus:
        raise DistUsageError(
            "--gpu-memory-fraction caps each rank's share of its GPU, and this session has CPU "
            "ranks: drop it, or start GPU ranks with --gpus."
        )
    if not 0 < f <= 1:
        raise DistUsageError(
            f"--gpu-memory-fraction {f}: give a fraction of the GPU's memory per rank, above 0 "
            "and at most 1 (two ranks sharing one GPU: 0.45 each leaves room for both)."
        )
    most = max(len(ranks) for ranks in plan.shared_gpus.values()) if plan.shared_gpus else 1
    if f * most > 1:
        raise DistUsageError(
            f"--gpu-memory-fraction {f} for {most} ranks on one GPU asks for {f * most:.2f} of "
            f"it: give at most {1 / most:.2f} (a little less leaves room for each rank's CUDA "
            "context)."
        )
    return float(f)


def parse_hosts(text: str) -> tuple[tuple[str, int], ...]:
    """``a:8,b:8`` -> ((a, 8), (b, 8)). A host without ``:N`` gets one slot."""
    hosts = []
    for part in filter(None, text.replace(" ", "").split(",")):
        name, _, slots = part.rpartition(":") if ":" in part else (part, "", "1")
        if not name or not slots.isdigit() or int(slots) < 1:
            raise DistUsageError(
                f"Bad --hosts entry {part!r}: use HOST:SLOTS, like --hosts node1:8,node2:8."
            )
        hosts.append((name, int(slots)))
    if not hosts:
        raise DistUsageError("--hosts is empty: use HOST:SLOTS, like --hosts node1:8,node2:8.")
    return tuple(hosts)


def parse_env(items: list[str] | None) -> tuple[tuple[str, str], ...]:
    out = []
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise DistUsageError(
                f"Bad --env {item!r}: use NAME=VALUE, like GLOO_SOCKET_IFNAME=eth0."
            )
        out.append((key, value))
    return tuple(out)


def _remote_plan(o: StartOptions) -> SessionPlan:
    """Plans for ranks started by ssh, mpiexec or Slurm (possibly on other hosts)."""
    import shlex

    launcher, hosts, nnodes, gpus_per_node = o.launcher, o.hosts, o.nnodes, o.gpus_per_node
    nprocs, backend, bind_address = o.nprocs, o.backend, o.bind_address
    host_list = parse_hosts(hosts) if hosts else ()
    if launcher == "local":
        raise DistUsageError("--hosts needs --launcher ssh, mpi or slurm.")
    gpus = remote_gpu_count(o.gpus, launcher)
    if launcher == "ssh" and not host_list:
        raise DistUsageError("--launcher ssh needs --hosts, like --hosts node1:8,node2:8.")
    if launcher == "slurm":
        if host_list:
            raise DistUsageError("Slurm picks the hosts: drop --hosts and give --nnodes N.")
        if not nnodes or nnodes < 1 or not (gpus_per_node or nprocs):
            raise DistUsageError(
                "--launcher slurm needs --nnodes N and --gpus-per-node G (or --nprocs for CPU "
                "ranks per node), e.g. --launcher slurm --nnodes 2 --gpus-per-node 8."
            )
        host_list = tuple((f"node{i}", gpus_per_node or nprocs) for i in range(nnodes))
    if launcher == "mpi" and not host_list:
        size = nprocs or gpus
        if not size or size < 1:
            raise DistUsageError("--launcher mpi needs --nprocs N (or --hosts HOST:SLOTS,...).")
        host_list = (("localhost", size),)
    world = sum(slots for _, slots in host_list)
    if launcher != "slurm" and nprocs is not None and nprocs != world:
        raise DistUsageError(f"--nprocs {nprocs} does not match the {world} slots of --hosts.")
    if gpus_per_node and any(slots != gpus_per_node for _, slots in host_list):
        raise DistUsageError(f"--gpus-per-node {gpus_per_node} does not match --hosts {hosts}.")
    on_gpu = bool(gpus_per_node or gpus) or backend == "nccl"
    backend = backend if backend != "auto" else ("nccl" if on_gpu else "gloo")
    remote_hosts = [h for h, _ in host_list if h not in LOOPBACK]
    if remote_hosts and bind_address in LOOPBACK:
        raise DistUsageError(
            f"Ranks on {', '.join(remote_hosts)} cannot reach this kernel on {bind_address}. "
            "Pass --bind-address ADDR, an address of this machine that those hosts reach."
        )
    placement = Placement(
        launcher=launcher,
        hosts=host_list,
        gpus_per_node=gpus_per_node,
        env=parse_env(o.env),
        ssh_args=tuple(shlex.split(o.ssh_args or "")),
        remote_python=o.remote_python or sys.executable,
        slurm=tuple((k, v) for k, v in o.slurm.items() if v),
    )
    return SessionPlan(
        world_size=world,
        backend=backend,
        gpus=tuple(str(i) for _, slots in host_list for i in range(slots)) if on_gpu else (),
        timeout=float(o.timeout),
        init_method=parse_init_method(o.init_method, bind_address),
        layout=_check_layout(world, o.layout),
        threads=_threads(o),
        bind_address=bind_address,
        placement=placement,
    )


def _threads(o: StartOptions) -> int | None:
    if o.threads is not None and o.threads < 1:
        raise DistUsageError(f"--threads {o.threads}: give at least 1 thread per rank.")
    return o.threads


def _check_layout(world: int, layout: dict) -> dict:
    from .layout import ParallelLayout

    given = {k: v for k, v in layout.items() if v is not None}
    try:
        return ParallelLayout(world_size=world, **given).to_dict()
    except (TypeError, ValueError) as e:
        raise DistUsageError(f"Bad parallel layout: {e}") from None
