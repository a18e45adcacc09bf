"""Validate ``%dist_start`` options into a :class:`SessionPlan` before any process starts. Pure.

Nothing here imports torch or ipyparallel: the caller passes in what it detected (how many
GPUs are visible), so every refusal is unit-testable in milliseconds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from urllib.parse import urlparse

from .errors import DistUsageError

BACKENDS = ("auto", "nccl", "gloo")


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
    threads_per_rank: int = 1
    bind_address: str = "127.0.0.1"

    @property
    def device_kind(self) -> str:
        return "cuda" if self.gpus else "cpu"


def parse_init_method(text: str | None, bind_address: str = "127.0.0.1") -> InitMethod:
    """``env://`` (default), ``tcp://HOST:PORT`` or ``file:///ABS/PATH``."""
    if not text or text == "env://":
        return InitMethod("env", host=bind_address)
    url = urlparse(text)
    if url.scheme == "tcp":
        if not url.hostname or url.port is None:
            raise DistUsageError(
                f"--init-method {text!r} needs a host and a port, like tcp://127.0.0.1:29500."
            )
        return InitMethod("tcp", host=url.hostname, port=url.port)
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
    *,
    gpus: int | None = None,
    nprocs: int | None = None,
    backend: str = "auto",
    timeout: float = 300.0,
    init_method: str | None = None,
    visible_gpus: list[str] | None = None,
    cpu_count: int | None = None,
    layout: dict | None = None,
    bind_address: str = "127.0.0.1",
) -> SessionPlan:
    """Check every option against what this machine has; raise DistUsageError on the first
    problem with a message that names the fix."""
    visible = list(visible_gpus or [])
    if backend not in BACKENDS:
        raise DistUsageError(f"Unknown --backend {backend!r}: choose one of {', '.join(BACKENDS)}.")
    if gpus is not None and nprocs is not None:
        raise DistUsageError(
            "Give --gpus N (one rank per GPU) or --nprocs N (CPU ranks), not both."
        )
    if timeout is None or timeout <= 0:
        raise DistUsageError(f"--timeout must be a positive number of seconds, got {timeout}.")
    on_gpu, world = _choose_devices(gpus, nprocs, backend, visible)
    if backend == "auto":
        backend = "nccl" if on_gpu else "gloo"
    if backend == "nccl" and not on_gpu:
        raise DistUsageError(
            "--backend nccl needs GPUs, and this session has CPU ranks. Use --backend gloo "
            "(the default for --nprocs) or start with --gpus N on a machine with CUDA."
        )
    method = parse_init_method(init_method, bind_address)
    layout_dict = _check_layout(world, layout or {})
    cores = cpu_count or os.cpu_count() or 1
    return SessionPlan(
        world_size=world,
        backend=backend,
        gpus=tuple(visible[:world]) if on_gpu else (),
        timeout=float(timeout),
        init_method=method,
        layout=layout_dict,
        threads_per_rank=max(1, cores // world),
        bind_address=bind_address,
    )


def _choose_devices(
    gpus: int | None, nprocs: int | None, backend: str, visible: list[str]
) -> tuple[bool, int]:
    if gpus is not None:
        if gpus <= 0:
            raise DistUsageError(f"--gpus must be at least 1, got {gpus}.")
        if not visible:
            raise DistUsageError(
                f"--gpus {gpus} asks for GPUs but CUDA sees none here. "
                f"Use --nprocs {max(gpus, 1)} for CPU ranks on gloo."
            )
        if gpus <= 0:
            raise DistUsageError(f"--gpus must be at least 1, got {gpus}.")
        if gpus > len(visible):
            raise DistUsageError(
                f"--gpus {gpus} asks for more GPUs than the {len(visible)} visible "
                f"({visible}). Use --gpus {len(visible)} or fewer."
            )
        return True, gpus
    if nprocs is not None:
        if nprocs <= 0:
            raise DistUsageError(f"--nprocs must be at least 1, got {nprocs}.")
        if backend == "nccl":
            raise DistUsageError(
                "--nprocs starts CPU ranks, which nccl cannot serve. Use --gpus N for nccl, "
                "or drop --backend to get gloo."
            )
        return False, nprocs
    if visible and backend != "gloo":
        return True, len(visible)
    raise DistUsageError(
        "No GPU is visible, so %dist_start cannot pick a size by itself. "
        "Use --nprocs N for N CPU ranks on gloo, e.g. %dist_start --nprocs 4."
    )


def _check_layout(world: int, layout: dict) -> dict:
    from .groups import ParallelLayout

    given = {k: v for k, v in layout.items() if v is not None}
    try:
        return ParallelLayout(world_size=world, **given).to_dict()
    except (TypeError, ValueError) as e:
        raise DistUsageError(f"Bad parallel layout: {e}") from None
