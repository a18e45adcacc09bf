"""Validate ``%dist_start`` options into a :class:`SessionPlan` before any process starts. Pure.

Nothing here imports torch or ipyparallel: the caller passes in what it detected (how many
GPUs are visible), so every refusal is unit-testable in milliseconds.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, replace
from urllib.parse import urlparse

from .devices import (
    check_sharing_nccl,
    choose_devices,
    remote_gpu_count,
    sharing,
    sharing_env,
    visible_entry,
)
from .errors import DistUsageError
from .keep import check_name, parse_duration
from .options import StartOptions

BACKENDS = ("auto", "nccl", "gloo")
LAUNCHERS = ("local", "ssh", "mpi", "slurm")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` keeps a socket to this machine. Names other than
    localhost count as reachable from outside (no DNS lookup here)."""
    import ipaddress

    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Placement:
    """Where ranks run. ``hosts`` lists (host, slots) in rank order: host i holds the next
    ``slots`` ranks, so LOCAL_RANK is the index inside a host and GROUP_RANK the host's."""

    launcher: str = "local"
    hosts: tuple[tuple[str, int], ...] = ()
    gpus_per_node: int | None = None
    env: tuple[tuple[str, str], ...] = ()  # extra variables for every engine
    ssh_args: tuple[str, ...] = ()
    remote_python: str = ""
    slurm: tuple[tuple[str, str], ...] = ()  # partition, account, time

    def rank_places(self, world_size: int) -> list[tuple[int, int, int]]:
        """(group_rank, local_rank, local_world_size) for every rank."""
        hosts = self.hosts or (("localhost", world_size),)
        places = []
        for host_index, (_, slots) in enumerate(hosts):
            places += [(host_index, i, slots) for i in range(slots)]
        return places

    @property
    def remote(self) -> bool:
        """Whether some rank runs on another host (Slurm picks hosts: assume so)."""
        return self.launcher == "slurm" or any(not is_loopback(h) for h, _ in self.hosts)

    @property
    def multi_host(self) -> bool:
        """Ranks may run away from the kernel's host (any host that is not loopback): they
        watch the kernel's store, not its pid, and dump stacks to no local file."""
        return len(self.hosts) > 1 or self.launcher in ("ssh", "slurm") or self.remote


@dataclass(frozen=True)
class InitMethod:
    """Where ranks rendezvous. ``kind`` is ``env``, ``tcp`` or ``file``."""

    kind: str
    host: str = "127.0.0.1"
    port: int = 0  # 0: the kernel picks a free port
    path: str = ""

    @property
    def url(self) -> str:
        if self.kind == "file":
            return f"file://{self.path}"
        if self.kind == "tcp":
            return f"tcp://{self.host}:{self.port}"
        return "env://"


@dataclass(frozen=True)
class SessionPlan:
    world_size: int
    backend: str  # "nccl" or "gloo", never "auto"
    gpus: tuple[str, ...]  # CUDA_VISIBLE_DEVICES entry per rank; empty on CPU
    timeout: float
    init_method: InitMethod
    layout: dict = field(default_factory=dict)  # ParallelLayout.to_dict()
    threads: int | None = None  # --threads; None: the rule (engine.bootstrap.threads_for)
    bind_address: str = "127.0.0.1"
    placement: Placement = field(default_factory=Placement)
    # Where ranks connect to the controller and the store: the listening address, or for
    # one that listens on every interface (0.0.0.0) an address of this host they can reach.
    controller_address: str = ""
    store_address: str = ""
    # Why engines are not forked from a warm template ("": they are; see template.py).
    template_off: str = ""
    nccl_version: tuple[int, ...] | None = None  # the NCCL torch loads here (None: no CUDA)
    gpu_memory_fraction: float | None = None  # --gpu-memory-fraction, per rank
    name: str = ""  # --name: a kept session's (see launch/keep.py)
    keep_s: float | None = None  # --keep: how long it waits for a kernel once none drives it

    @property
    def device_kind(self) -> str:
        return "cuda" if self.gpus else "cpu"

    def cuda_devices(self, rank: int) -> tuple[str | None, int] | None:
        """(CUDA_VISIBLE_DEVICES, device index) for ``rank``, None on CPU. As under torchrun,
        a rank sees every GPU its node's ranks use, in LOCAL_RANK order, so its own GPU is
        ``cuda:LOCAL_RANK`` and ``torch.cuda.set_device(LOCAL_RANK)`` works unchanged.
        Ranks sharing a GPU see it once (CUDA, and torch's _parse_visible_devices, treat a
        repeated entry as the end of the list), so their device is its place in that list,
        not LOCAL_RANK. Ranks started by ssh, mpiexec or Slurm get None for
        CUDA_VISIBLE_DEVICES: they keep what their host or scheduler gave them (see
        ``launcher_device``)."""
        if not self.gpus:
            return None
        places = self.placement.rank_places(self.world_size)
        node, local_rank, _ = places[rank]
        if self.placement.launcher != "local":
            return None, local_rank
        on_node = sorted((lr, self.gpus[r]) for r, (n, lr, _) in enumerate(places) if n == node)
        unique = list(dict.fromkeys(gpu for _, gpu in on_node))
        return ",".join(unique), unique.index(self.gpus[rank])

    @property
    def shared_gpus(self) -> dict[str, tuple[int, ...]]:
        """GPUs that several ranks use, with their ranks (``--gpus 0,0``)."""
        return sharing(self.gpus)

    def sharing_env(self, rank: int, session: str) -> dict[str, str]:
        """What NCCL needs on ``rank`` for ranks that share a GPU (``devices.sharing_env``)."""
        if self.backend != "nccl":
            return {}
        return sharing_env(self.gpus, rank, self.nccl_version, session)

    def physical_gpu(self, rank: int) -> str | None:
        """``rank``'s GPU as the kernel's CUDA_VISIBLE_DEVICES names it (an id, or a UUID
        where that lists UUIDs). None on CPU, and for ranks whose host or scheduler picks
        their GPU: such a rank knows it (``devices.visible_entry``), the kernel does not."""
        cuda = self.cuda_devices(rank)
        if cuda is None or cuda[0] is None:
            return None
        return visible_entry(*cuda)


def launcher_device(visible: str | None, local_rank: int, local_world: int) -> int:
    """The device index of a rank whose host or scheduler chose its GPUs, from the
    CUDA_VISIBLE_DEVICES it inherited (Slurm sets it to the job's GPUs on a shared node):
    its LOCAL_RANK-th GPU of those, or the only one when the launcher bound one GPU to
    each rank (``srun --gpus-per-task=1``). Never a GPU outside that list."""
    if visible is None:  # the host gives us all its GPUs
        return local_rank
    entries = [x for x in visible.split(",") if x.strip()]
    if len(entries) >= local_world:
        return local_rank
    if len(entries) == 1:
        return 0
    raise DistUsageError(
        f"This host gives {len(entries)} GPUs (CUDA_VISIBLE_DEVICES={visible!r}) to its "
        f"{local_world} ranks. Ask the scheduler for {local_world} GPUs per node "
        "(--gpus-per-node), or start fewer ranks per host."
    )


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


NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def nccl_error_handling(plan: SessionPlan, environ: dict) -> str:
    """The TORCH_NCCL_ASYNC_ERROR_HANDLING the ranks run with: the user's (--env, or the
    kernel's environment that local engines inherit), else the session's "2"."""
    given = dict(plan.placement.env)
    if NCCL_ERROR_HANDLING in given:
        return given[NCCL_ERROR_HANDLING]
    if not plan.placement.remote and NCCL_ERROR_HANDLING in environ:
        return environ[NCCL_ERROR_HANDLING]
    return "2"


def soft_restart_fails(plan: SessionPlan, environ: dict) -> str | None:
    """Why a soft restart cannot recover from a timed-out collective, None when it can. On
    NCCL only TORCH_NCCL_ASYNC_ERROR_HANDLING=2 keeps a timed-out rank alive: 1 and 3
    (torch's default) tear it down, 0 leaves its GPU work hanging."""
    if plan.backend != "nccl":
        return None
    value = nccl_error_handling(plan, environ)
    if value == "2":
        return None
    what = "leaves the GPU work hanging" if value == "0" else "tears a timed-out rank down"
    return f"with {NCCL_ERROR_HANDLING}={value} NCCL {what}"
