"""Which GPU each rank uses, from ``--gpus``. Pure.

``--gpus N`` takes the first N GPUs the kernel sees. ``--gpus 4,5,6,7`` or ``--gpus 2-5``
takes GPUs by id, for a shared machine. Ids count the kernel's visible GPUs as torch does:
id k is the kernel's ``cuda:k``, the k-th entry of its CUDA_VISIBLE_DEVICES (``visible``
below, one entry per GPU torch sees). A rank's physical GPU is the entry it is given.
An id listed more than once (``--gpus 0,0``) puts that many ranks on the GPU: they share
it, and NCCL needs to be told (``sharing_env``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from .errors import DistUsageError
from .options import count_or_ids
from .ranks import format_ranks

SPEC_HELP = "a count (--gpus 4) or GPU ids (--gpus 4,5,6,7, --gpus 2-5, or --gpus 3, for one)"
MAX_GPU_ID = 4095  # bounds a range before it is expanded; no machine has that many GPUs
ID_RANGE = re.compile(r"(\d+)(?:-(\d+))?", re.ASCII)

GpuSpec = int | str | Sequence[int] | None  # what StartOptions.gpus may hold


def requested_gpus(gpus: GpuSpec) -> int | tuple[int, ...] | None:
    """``--gpus`` as a count (an int, unchecked: the plan refuses one below 1) or as ids
    (a tuple, in the order given); None when not given."""
    if gpus is None or isinstance(gpus, int):
        return gpus
    if isinstance(gpus, str):
        value = count_or_ids(gpus)
        return value if isinstance(value, int) else parse_gpu_ids(value)
    return parse_gpu_ids(spec_text(gpus))


def spec_text(gpus: GpuSpec) -> str:
    """``--gpus`` as the user wrote it, for messages (a list of ids as ``4,5``)."""
    if isinstance(gpus, (str, int)) or gpus is None:
        return str(gpus)
    return ",".join(str(i) for i in gpus) + ("," if len(gpus) == 1 else "")


def gpu_count(gpus: GpuSpec) -> int | None:
    """How many ranks ``--gpus`` asks for: the count, or one per id."""
    wanted = requested_gpus(gpus)
    return len(wanted) if isinstance(wanted, tuple) else wanted


def parse_gpu_ids(spec: str) -> tuple[int, ...]:
    """``4,5,6,7``, ``2-5`` or a mix (``0,2-3``) -> the ids, in the order given, repeats
    kept (``0,0``: two ranks on GPU 0). A trailing comma makes one id a list: ``--gpus 3,``
    is GPU 3, where ``--gpus 3`` is three GPUs."""
    entries = spec.replace(" ", "").split(",")
    if len(entries) > 1 and entries[-1] == "":
        entries.pop()
    return tuple(i for entry in entries for i in _id_range(spec, entry))


def _id_range(spec: str, entry: str) -> list[int]:
    match = ID_RANGE.fullmatch(entry)
    if not match:
        raise DistUsageError(f"Bad --gpus {spec!r}: give {SPEC_HELP}.")
    first, last = int(match[1]), int(match[2] or match[1])
    if last < first:
        raise DistUsageError(f"--gpus {spec}: write the range low to high, like {last}-{first}.")
    if last > MAX_GPU_ID:
        raise DistUsageError(f"--gpus {spec}: there is no GPU {last}; ids count from 0.")
    return list(range(first, last + 1))


def choose_devices(
    gpus: GpuSpec, nprocs: int | None, backend: str, visible: list[str]
) -> tuple[tuple[str, ...], int]:
    """(the CUDA_VISIBLE_DEVICES entry of each rank's GPU, empty for CPU ranks; the number
    of ranks), from ``--gpus``/``--nprocs`` and what the kernel sees."""
    wanted = requested_gpus(gpus)
    if isinstance(wanted, tuple):
        return _by_id(spec_text(gpus), wanted, nprocs, visible), len(wanted)
    if wanted is not None and nprocs is not None:
        raise DistUsageError(
            "Give --gpus N (one rank per GPU) or --nprocs N (CPU ranks), not both."
        )
    if wanted is not None:
        return _by_count(wanted, visible), wanted
    if nprocs is not None:
        if nprocs <= 0:
            raise DistUsageError(f"--nprocs must be at least 1, got {nprocs}.")
        if backend == "nccl":
            raise DistUsageError(
                "--nprocs starts CPU ranks, which nccl cannot serve. Use --gpus N for nccl, "
                "or drop --backend to get gloo."
            )
        return (), nprocs
    if visible and backend != "gloo":
        return tuple(visible), len(visible)
    raise DistUsageError(
        "No GPU is visible, so %dist_start cannot pick a size by itself. "
        "Use --nprocs N for N CPU ranks on gloo, e.g. %dist_start --nprocs 4."
    )


def _by_count(gpus: int, visible: list[str]) -> tuple[str, ...]:
    if gpus <= 0:
        raise DistUsageError(
            f"--gpus must be at least 1, got {gpus}. To pick GPUs by id, list them: "
            "--gpus 0, (one GPU) or --gpus 0,1."
        )
    if not visible:
        raise DistUsageError(
            f"--gpus {gpus} asks for GPUs but CUDA sees none here. "
            f"Use --nprocs {gpus} for CPU ranks on gloo."
        )
    if gpus > len(visible):
        raise DistUsageError(
            f"--gpus {gpus} asks for more GPUs than the {len(visible)} visible "
            f"({visible}). Use --gpus {len(visible)} or fewer."
        )
    return tuple(visible[:gpus])


def _by_id(spec: str, ids: tuple[int, ...], nprocs: int | None, visible: list[str]) -> tuple:
    if nprocs is not None:
        raise DistUsageError(
            f"--gpus {spec} starts one rank on each listed GPU ({len(ids)} ranks): drop --nprocs."
        )
    if not visible:
        raise DistUsageError(
            f"--gpus {spec} asks for GPUs by id but CUDA sees none here. "
            f"Use --nprocs {len(ids)} for CPU ranks on gloo."
        )
    missing = [i for i in ids if i >= len(visible)]
    if missing:
        raise DistUsageError(
            f"--gpus {spec}: there is no GPU {missing[0]}. This kernel sees {len(visible)} GPUs "
            f"({','.join(visible)} in CUDA_VISIBLE_DEVICES terms), ids 0-{len(visible) - 1} as "
            "torch counts them: pick ids from those."
        )
    return tuple(visible[i] for i in ids)


def remote_gpu_count(gpus: GpuSpec, launcher: str) -> int | None:
    """``--gpus`` for ranks that ssh, mpiexec or Slurm start: a count. Ids are refused,
    since those ranks use the GPUs their host or scheduler gives them (launcher_device)."""
    wanted = requested_gpus(gpus)
    if not isinstance(wanted, tuple):
        return wanted
    spec, n = spec_text(gpus), len(wanted)
    if launcher == "slurm":
        fix = f"Slurm picks each node's GPUs: give --gpus-per-node {n}."
    else:
        ids = ",".join(map(str, wanted))
        fix = (
            f"Give {n} slots per host (--hosts HOST:{n},...) and pick the GPUs with "
            f"--env CUDA_VISIBLE_DEVICES={ids} (each host's own ids)."
        )
    raise DistUsageError(
        f"--gpus {spec} picks GPUs of this machine by id, but --launcher {launcher} ranks "
        f"use the GPUs their host gives them. {fix}"
    )


def visible_entry(visible: str | None, index: int) -> str:
    """The physical GPU of ``cuda:index`` for a process whose CUDA_VISIBLE_DEVICES is
    ``visible``: its entry there (an id or a GPU UUID), or the index itself when nothing
    narrows the GPUs. What a rank whose host chose its GPUs reports."""
    entries = [x.strip() for x in (visible or "").split(",") if x.strip()]
    return entries[index] if entries else str(index)


def rank_gpu(gpus: Sequence[str], index: int) -> tuple[str, int]:
    """(CUDA_VISIBLE_DEVICES, device index) of the ``index``-th rank of one machine whose
    ranks use ``gpus`` (a CUDA_VISIBLE_DEVICES entry each, in local rank order). As under
    torchrun, a rank sees every GPU of its machine's ranks, in that order, so its own is
    ``cuda:LOCAL_RANK``; ranks sharing a GPU see it once (CUDA, and torch's
    _parse_visible_devices, take a repeated entry as the end of the list), so their device
    is its place in that list. A session's ranks and an exported script's both use this."""
    unique = list(dict.fromkeys(gpus))
    return ",".join(unique), unique.index(gpus[index])


def sharing(gpus: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """The GPUs more than one rank uses, each with its ranks: ``("0", "0", "1")`` ->
    ``{"0": (0, 1)}``. Empty when every rank has a GPU of its own."""
    ranks: dict[str, list[int]] = {}
    for rank, gpu in enumerate(gpus):
        ranks.setdefault(gpu, []).append(rank)
    return {gpu: tuple(rs) for gpu, rs in ranks.items() if len(rs) > 1}


def slot_on_gpu(gpus: Sequence[str], rank: int) -> int:
    """Which of its GPU's ranks ``rank`` is: 0 for the first rank on that GPU, 1 for the
    second... Ranks of one slot never share a GPU, so one NCCL host id per slot suffices."""
    return gpus[:rank].count(gpus[rank])


# NCCL refuses two ranks of a communicator on one GPU: init.cc's check ("Duplicate GPU
# detected") compares the peers' host hash and bus id. Two ways past it, by version:
# - NCCL >= 2.30 reads NCCL_MULTI_RANK_GPU_ENABLE=1 (init.cc: the duplicate check then
#   compares host hash and GPU UUID only where the flag is off) and keeps its intra-node
#   transports; experimental (public runs on 2.30 and 2.31; not yet run here).
# - Before that, misc/utils.cc getHostHash() takes the host hash from NCCL_HOSTID when set,
#   read once per process before the first communicator: ranks of one GPU get distinct ids
#   and so look like separate nodes. P2P and SHM need equal host hashes (transport/p2p.cc,
#   shm.cc), so those peers connect over the NET transport: NCCL_NET=Socket (not an IB
#   HCA, which a one-GPU box may lack), on the loopback interface the session already
#   names (NCCL_SOCKET_IFNAME, engine.bootstrap.backend_defaults), and NVLS off (it needs
#   every rank of a node on a distinct GPU). Ranks on distinct GPUs of one slot keep P2P.
MULTI_RANK_GPU_NCCL = (2, 30, 0)
HOSTID_NCCL = (2, 12, 0)  # the oldest misc/utils.cc read that takes NCCL_HOSTID


def sharing_env(
    gpus: Sequence[str], rank: int, nccl_version: tuple[int, ...] | None, session: str
) -> dict[str, str]:
    """What ``rank`` needs, before its first NCCL communicator, when its GPU is shared;
    ``{}`` when no rank shares a GPU. ``session`` keeps host ids apart between sessions."""
    if not sharing(gpus):
        return {}
    if nccl_version is not None and tuple(nccl_version) >= MULTI_RANK_GPU_NCCL:
        return {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
    return {
        "NCCL_HOSTID": f"infini-{session}-slot{slot_on_gpu(gpus, rank)}",
        "NCCL_NET": "Socket",
        "NCCL_NVLS_ENABLE": "0",
    }


def check_sharing_nccl(gpus: Sequence[str], backend: str, nccl_version) -> None:
    """Refuse shared GPUs on an NCCL that can do neither (before anything starts)."""
    if backend != "nccl" or not sharing(gpus) or nccl_version is None:
        return
    if tuple(nccl_version) < HOSTID_NCCL:
        have = ".".join(map(str, nccl_version))
        raise DistUsageError(
            f"Ranks sharing a GPU need NCCL >= {'.'.join(map(str, HOSTID_NCCL))} "
            f"(NCCL_HOSTID), and this torch loads NCCL {have}. Give each rank its own GPU, "
            "or use --backend gloo to share one."
        )


def sharing_text(gpus: Sequence[str]) -> str:
    """'GPU 0: ranks 0-1, shared: correctness, not speed', one clause per shared GPU."""
    shared = sharing(gpus)
    clauses = [f"GPU {gpu}: ranks {format_ranks(list(rs))}" for gpu, rs in shared.items()]
    return "; ".join(clauses) + ", shared: correctness, not speed" if clauses else ""
