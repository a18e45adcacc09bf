"""What this machine has, asked once per start: its GPUs as the kernel sees them, the NCCL
torch loads, its IP addresses. The plan's checks (core/plan_checks.py) are pure and take
these as facts."""

from __future__ import annotations

import os

import psutil


def host_addresses() -> list[str]:
    """This machine's IPv4 addresses (for a bind address of 0.0.0.0: see plan.reachable)."""
    import socket

    return [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET
    ]


def nccl_version() -> tuple[int, ...] | None:
    """The NCCL this torch loads (the ranks' too: local ranks run this interpreter); None
    without CUDA. ``torch.cuda.nccl.version()`` reads the library's version, no device."""
    try:
        import torch

        return tuple(torch.cuda.nccl.version()) if torch.cuda.is_available() else None
    except Exception:
        return None


def visible_cuda_devices() -> list[str]:
    """CUDA_VISIBLE_DEVICES entries of the GPUs this process may use, one per GPU."""
    try:
        import torch

        n = torch.cuda.device_count()
    except Exception:
        return []
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env:
        return [x.strip() for x in env.split(",") if x.strip()][:n]
    return [str(i) for i in range(n)]


def plan_from_options(options=None, **keywords):
    """The checked plan for ``options`` (or for the StartOptions the keywords make), with
    what this machine has."""
    from ..core.errors import DistUsageError
    from ..core.options import StartOptions
    from ..core.plan_checks import make_plan

    try:
        options = options or StartOptions(**keywords)
    except TypeError as e:  # a keyword that is no option
        raise DistUsageError(f"Unknown start option: {e}. See %dist_start --help.") from None
    return make_plan(
        options,
        visible_gpus=visible_cuda_devices(),
        host_addresses=host_addresses(),
        nccl_version=nccl_version(),
    )
