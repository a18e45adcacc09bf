"""``SessionPlan``: a session's validated settings (ranks, backend, GPUs, init method,
placement, layout), frozen once ``%dist_start``'s options passed their checks
(plan_checks.py), and what follows from them: each rank's place and GPU, the NCCL settings
of ranks sharing a GPU, whether a soft restart can recover. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .devices import rank_gpu, sharing, sharing_env, visible_entry
from .errors import DistUsageError

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
    relay: bool = False  # --relay: cells through a relay per host (engine/host_relay.py)

    @property
    def device_kind(self) -> str:
        return "cuda" if self.gpus else "cpu"

    def cuda_devices(self, rank: int) -> tuple[str | None, int] | None:
        """(CUDA_VISIBLE_DEVICES, device index) for ``rank``, None on CPU: the GPUs of its
        node's ranks, its own at ``cuda:LOCAL_RANK`` (``devices.rank_gpu``, which ranks
        sharing a GPU change). Ranks started by ssh, mpiexec or Slurm get None for
        CUDA_VISIBLE_DEVICES: they keep what their host or scheduler gave them (see
        ``launcher_device``)."""
        if not self.gpus:
            return None
        places = self.placement.rank_places(self.world_size)
        node, local_rank, _ = places[rank]
        if self.placement.launcher != "local":
            return None, local_rank
        on_node = sorted((lr, self.gpus[r]) for r, (n, lr, _) in enumerate(places) if n == node)
        return rank_gpu([gpu for _, gpu in on_node], local_rank)

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


def plan_to_json(plan: SessionPlan) -> dict:
    """The plan as plain JSON data (a kept session's connection data: never a pickle, which
    would run code when read back)."""
    from dataclasses import asdict

    return asdict(plan)


def plan_from_json(data: dict) -> SessionPlan:
    """The plan ``plan_to_json`` wrote: the same fields, tuples where the plan has tuples.
    KeyError, TypeError or ValueError for data that is not such a plan."""
    data = dict(data)
    p = dict(data.pop("placement"))
    placement = Placement(
        launcher=str(p["launcher"]),
        hosts=tuple((str(h), int(n)) for h, n in p["hosts"]),
        gpus_per_node=p["gpus_per_node"],
        env=tuple((str(k), str(v)) for k, v in p["env"]),
        ssh_args=tuple(str(a) for a in p["ssh_args"]),
        remote_python=str(p["remote_python"]),
        slurm=tuple((str(k), str(v)) for k, v in p["slurm"]),
    )
    nccl = data.pop("nccl_version")
    return SessionPlan(
        placement=placement,
        init_method=InitMethod(**data.pop("init_method")),
        gpus=tuple(str(g) for g in data.pop("gpus")),
        nccl_version=tuple(int(v) for v in nccl) if nccl is not None else None,
        layout=dict(data.pop("layout")),
        **data,
    )


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
