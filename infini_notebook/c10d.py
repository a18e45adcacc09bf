"""What torch.distributed tells about its process groups, through its private corners
(the default group's bound device, ``_world.pg_names``, a backend's options), kept in one
place for ``groups``."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def group_timeout(pg: ProcessGroup | None = None) -> timedelta | None:
    """``pg``'s collective timeout (default: the world's, as init_process_group was given);
    None when its backend does not say, and torch's default then applies."""
    import torch
    import torch.distributed as dist

    pg = dist.group.WORLD if pg is None else pg
    for device in ("cuda", "cpu"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except Exception:  # no backend for that device, or one without options
            continue
    return None


def can_split() -> bool:
    """NCCL can split communicators only once the default group is bound to a device."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_group

    default = _get_default_group()
    if getattr(default, "bound_device_id", None) is None:
        return False
    try:
        import torch

        backend = default._get_backend(torch.device(default.bound_device_id.type))
        return bool(backend.supports_splitting) and hasattr(dist, "split_group")
    except Exception:
        return False


def covers_world(partition: list[list[int]]) -> bool:
    import torch.distributed as dist

    return sum(len(g) for g in partition) == dist.get_world_size()


def pg_names() -> dict:
    from torch.distributed.distributed_c10d import _world

    return _world.pg_names


def same_everywhere(value: int) -> bool:
    """True when ``value`` is equal on every rank (one tiny all_reduce on the default group)."""
    import torch
    import torch.distributed as dist

    device = "cpu"
    if "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
        device = f"cuda:{torch.cuda.current_device()}"
    t = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t[0]) == value and int(-t[1]) == value
