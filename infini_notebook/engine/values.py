"""The rank's side of %dist_pull and %dist_push (kernel/transfer.py): a namespace value
for the kernel, tensors moved to CPU, and values set in the namespace, directly or through
the kernel's shared-memory file (shm_transport.py)."""

from __future__ import annotations

from typing import Any

from . import shm_transport
from .bootstrap import user_namespace


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
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):  # a namedtuple
        return type(value)(*(_to_cpu(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def push_values(values: dict) -> None:
    user_namespace().update(values)


def pull_shared(name: str, segment: shm_transport.Segment) -> Any:
    """``pull_value`` through the kernel's shared-memory file ``segment`` (see
    shm_transport): a ``Packed``, or the value itself where it cannot go that way."""
    return shm_transport.pack_or_value(pull_value(name), segment)


def push_shared(
    plain: dict, packed: shm_transport.Packed | None, segment: shm_transport.Segment | None
) -> bool:
    """``push_values`` of ``plain`` (as ipyparallel sends values) and of what ``packed`` holds
    in the kernel's file ``segment``. False, with nothing set, when this engine does not find
    that file (it sees another /dev/shm, or the kernel gave up on the push and removed it):
    the kernel then sends the values the ordinary way, if it still waits."""
    values = dict(plain)
    if packed is not None:
        try:
            values.update(shm_transport.unpack(packed, segment))
        except (FileNotFoundError, shm_transport.ForeignFile):
            return False
    push_values(values)
    return True
