"""Notes of the sends and receives a profiled cell posts, for core/gloo_ops.py: gloo's
trace events (``gloo:send``, ``gloo:recv``) name neither the group nor the peer, and its
Flight Recorder records no p2p work. torch.distributed's send/recv/isend/irecv and
batch_isend_irecv all post through ``ProcessGroup.send``/``recv``/``recv_anysource``
(distributed_c10d.py, torch 2.13), so while armed those methods note the op, the group's
name and description, the peer's global rank, the calling thread and the wall clock, then
call torch's own."""

from __future__ import annotations

import threading
import time

_state: dict = {"originals": {}, "calls": []}
_METHODS = {"send": "send", "recv": "recv", "recv_anysource": "recv"}


def arm() -> None:
    """Start noting (once; ``take`` ends it)."""
    import torch.distributed as dist

    if _state["originals"]:
        return
    _state["calls"] = []
    for method, op in _METHODS.items():
        # The class's own entry (pybind11's instancemethod), not getattr's: that is the
        # unbound builtin, which set back on the class is no method (self never passed).
        original = vars(dist.ProcessGroup).get(method)
        if original is not None:
            _state["originals"][method] = original
            call = getattr(dist.ProcessGroup, method)
            setattr(dist.ProcessGroup, method, _noting(call, op, method == "recv_anysource"))


def take() -> list[dict]:
    """Stop noting; the notes since ``arm``."""
    import torch.distributed as dist

    for method, original in _state["originals"].items():
        setattr(dist.ProcessGroup, method, original)
    _state["originals"] = {}
    calls, _state["calls"] = _state["calls"], []
    return calls


def _noting(original, op: str, any_source: bool):
    def method(self, tensors, *args, **kwargs):
        peer = None if any_source or not args else args[0]
        _state["calls"].append(
            {
                "op": op,
                "group": _name(self),
                "desc": getattr(self, "group_desc", ""),
                "peer": None if peer is None else _global(self, peer),
                "tid": threading.get_native_id(),
                "wall_ns": time.time_ns(),
            }
        )
        return original(self, tensors, *args, **kwargs)

    return method


def _name(group) -> str:
    try:
        return group.group_name
    except Exception:  # a group made outside torch.distributed's registry
        return ""


def _global(group, peer: int) -> int | None:
    import torch.distributed as dist

    try:
        return dist.get_global_rank(group, peer)
    except Exception:
        return None
