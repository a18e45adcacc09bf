"""The start options, written once: ``%dist_start``'s flags are made from these fields,
``infini_notebook.start(**kw)`` fills them by keyword, and ``plan_checks.make_plan`` checks
them.
Pure: no imports beyond the standard library."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

LAYOUT_FIELDS = ("tp", "cp", "pp", "dp", "order", "zero1")


def _opt(default=None, help: str = "", **argparse):
    """A field with its command-line flag's argparse keywords (``flag`` renames it)."""
    return field(default=default, metadata={"help": help, **argparse})


def count_or_ids(text: str) -> int | str:
    """``--gpus``: a count stays an int, as before; anything else (ids like ``4,5,6,7`` or
    ``2-5``) stays text, for ``plan_checks.make_plan`` to check against the visible GPUs."""
    try:
        return int(text)
    except ValueError:
        return text.strip()


@dataclass
class StartOptions:
    gpus: int | str | None = _opt(
        type=count_or_ids,
        help="one rank per GPU (nccl): a count N (the first N visible), or GPU ids by "
        "CUDA_VISIBLE_DEVICES position, like 4,5,6,7 or 2-5 (3, for one); as under torchrun "
        "each rank sees its node's GPUs and is pinned to cuda:LOCAL_RANK. An id listed "
        "twice shares that GPU (0,0: two ranks on GPU 0, for correctness, not speed; "
        "such ranks use `device`, their GPU's place in the list they see)",
    )
    nprocs: int | None = _opt(type=int, help="number of CPU ranks (gloo)")
    gpu_memory_fraction: float | None = _opt(
        type=float,
        help="cap each rank's CUDA memory at this fraction of its GPU (0-1], so ranks that "
        "share a GPU (--gpus 0,0) cannot starve each other",
    )
    threads: int | None = _opt(
        type=int,
        help="threads per rank for torch, OpenMP and BLAS (default: the CPUs this process may "
        "use on the rank's host, divided by that host's ranks)",
    )
    backend: str = _opt("auto", help="auto (default), nccl or gloo")
    timeout: float = _opt(300.0, type=float, help="collective timeout in seconds")
    init_method: str = _opt("env://", help="env:// (default), tcp://HOST:PORT or file:///PATH")
    tp: int | None = _opt(type=int, help="tensor-parallel size")
    cp: int | None = _opt(type=int, help="context-parallel size")
    pp: int | None = _opt(type=int, help="pipeline-parallel size")
    dp: int | None = _opt(type=int, help="data-parallel size (default: the rest)")
    order: str | None = _opt(help="dims fastest first, default tp-cp-dp-pp (Megatron)")
    zero1: int | None = _opt(type=int, help="ZeRO-1 shard group size inside each dp group")
    bind_address: str = _opt(
        "127.0.0.1", help="address the store and controller listen on (default loopback)"
    )
    launcher: str = _opt("local", help="local (default), ssh, mpi or slurm")
    hosts: str | None = _opt(help="HOST:SLOTS,... where ranks run (ssh, mpi), e.g. a:8,b:8")
    nnodes: int | None = _opt(type=int, help="number of nodes (slurm)")
    gpus_per_node: int | None = _opt(type=int, help="GPUs (ranks) per node (slurm, ssh)")
    partition: str | None = _opt(help="slurm partition")
    account: str | None = _opt(help="slurm account")
    time_limit: str | None = _opt(flag="--time", help="slurm time limit, e.g. 01:00:00")
    env: list[str] | None = _opt(action="append", help="NAME=VALUE for every rank (repeatable)")
    ssh_args: str | None = _opt(help="extra ssh options, quoted: '-i key -p 2222'")
    remote_python: str | None = _opt(help="python on the hosts (default: this kernel's)")
    no_template: bool = _opt(
        False,
        action="store_true",
        help="start each engine as a new process instead of forking it from a warm "
        "template that has imported torch once (the default for the local launcher on Linux; "
        "it also forks a spare engine per rank while the session is idle, so that a hard "
        "restart only has to set them up)",
    )

    relay: bool = _opt(
        False,
        action="store_true",
        help="send each cell once to a relay process on the ranks' host, which hands it to "
        "each rank and sends the kernel their answers packed: the kernel's cost per cell "
        "grows with hosts, not ranks (docs/scale.md; ranks on this machine, not with --keep)",
    )
    name: str | None = _opt(help="the session's name, for %%dist_attach NAME (with --keep)")
    keep: str | None = _opt(
        nargs="?",  # bare --keep: parse_duration's error, which shows how to write one
        const="",
        help="keep the session when the kernel dies or restarts: its ranks wait this long "
        "(90s, 10m, 2h) for a kernel to %%dist_attach NAME, then end (with --name)",
    )

    @classmethod
    def from_args(cls, args) -> StartOptions:
        """From ``%dist_start``'s parsed arguments (an argparse Namespace)."""
        return cls(**vars(args))

    @property
    def layout(self) -> dict:
        return {name: getattr(self, name) for name in LAYOUT_FIELDS}

    @property
    def slurm(self) -> dict:
        return {"partition": self.partition, "account": self.account, "time": self.time_limit}


def flag_specs() -> list[tuple[str, dict]]:
    """``(flag, argparse keywords)`` per option, in order, for ``%dist_start``."""
    specs = []
    for f in fields(StartOptions):
        kw = dict(f.metadata)
        flag = kw.pop("flag", "--" + f.name.replace("_", "-"))
        if flag != "--" + f.name.replace("_", "-"):
            kw["dest"] = f.name
        if f.default is not None:
            kw["default"] = f.default
        specs.append((flag, kw))
    return specs
