"""``%dist_heal`` on a rank: what it holds under a name (``survey``), and the transfer of a
name's value from a healthy replica over the process group (``transfer``): the source
broadcasts a small header (kinds, shapes, an optimizer's state skeleton, a plain value or a
module pickled without its tensor data), then each tensor's bytes; receivers overwrite
their own object in place (a module's parameters and buffers, a tensor, a DTensor's local
tensor) or build a new one (a module unpickled onto empty storages that the stream then
fills, a new tensor or DTensor, an optimizer's state loaded into the optimizer they made).
Nothing goes through the kernel. The plan (who sends to whom) is core/heal_plan.py.

Whole groups use ``broadcast`` / ``broadcast_object_list`` on the group (its gloo twin for
CPU tensors and the header); a transfer to some ranks of a group only uses ``send`` and
``recv`` from the source, so the group's other ranks keep their own values untouched.
"""

from __future__ import annotations

import time
from typing import Any

from .bootstrap import user_namespace
from .heal_values import (
    empty_tensor,
    is_dtensor,
    kind_of,
    local,
    module_tensors,
    pack,
    session_mesh,
    unpack,
)


# ----- survey --------------------------------------------------------------------------------
def survey(names: list[str]) -> dict[str, dict]:
    """What this rank holds under each name: ``{"missing": why}`` or its kind ("module",
    "optimizer", "tensor", "value"), type, tensor signature (``sig``: leaf -> [local
    shape, dtype, device type]), DTensor leaves, FSDP shard groups, DDP wrapping."""
    ns = user_namespace()
    return {name: describe(name, ns) for name in names}


def describe(name: str, ns: dict) -> dict:
    import torch

    try:
        obj = eval(name, ns)
    except Exception as e:
        return {"missing": f"{type(e).__name__}: {e}"}
    kind = kind_of(obj)
    out: dict[str, Any] = {"kind": kind, "type": type(obj).__name__}
    if kind == "optimizer":
        out["groups"] = [len(g["params"]) for g in obj.param_groups]
    elif kind in ("module", "tensor"):
        entries = module_tensors(obj) if kind == "module" else [("", obj)]
        with torch.no_grad():
            out["sig"] = {n: _signature(local(t)) for n, t in entries}
        out["dtensors"] = [dtensor_info(n, t, ns) for n, t in entries if is_dtensor(t)]
        if kind == "module":
            out["fsdp"] = _fsdp_ranks(obj)
            out["ddp"] = any(
                isinstance(m, torch.nn.parallel.DistributedDataParallel) for m in obj.modules()
            )
    return out


def _signature(t) -> list:
    return [list(t.shape), str(t.dtype).replace("torch.", ""), t.device.type]


def dtensor_info(leaf: str, t, ns: dict) -> dict:
    """A DTensor's mesh (global ranks), dim names, placements, which dims are not
    Replicate, this rank's coordinates, and whether its mesh is the session's ``mesh``
    (or a slice of it by dim names: a receiver lacking it can make the same)."""
    mesh = t.device_mesh
    dims = list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
    mine = session_mesh(ns, dims)
    return {
        "leaf": leaf,
        "dims": dims,
        "mesh": mesh.mesh.tolist(),
        "placements": [repr(p) for p in t.placements],
        "sharded": [i for i, p in enumerate(t.placements) if not p.is_replicate()],
        "coord": list(mesh.get_coordinate() or []),
        "session_mesh": mine is not None and mine.mesh.tolist() == mesh.mesh.tolist(),
    }


def _fsdp_ranks(module) -> list[int]:
    """The ranks FSDP (FullyShardedDataParallel, torch's first FSDP) shards ``module``'s
    parameters over; FSDP2 (fully_shard) shards into DTensors, seen as such."""
    import torch.distributed as dist

    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:
        return []
    ranks: set[int] = set()
    for m in module.modules():
        if isinstance(m, FSDP) and getattr(m, "process_group", None) is not None:
            ranks |= set(dist.get_process_group_ranks(m.process_group))
    return sorted(ranks)


# ----- transfer ------------------------------------------------------------------------------
def transfer(name: str, kind: str, parts: list[dict]) -> dict | None:
    """This rank's side of healing ``name`` over its group of ``kind``: each of ``parts``
    (core/heal_plan.py ``Transfer.part_for``) in order, as the source or a receiver.
    Every rank is called (building a gloo twin on first use is collective); a rank with
    no part returns None. Returns ``{"nbytes", "seconds"}`` (and ``"error"``)."""
    import torch

    ns = user_namespace()
    groups = ns["groups"]
    groups.get(kind)  # collective on first use (a kind not built at start: cp-dp)
    if groups.backend != "gloo":
        groups.cpu_group(kind)
    if not parts:
        return None
    t0 = time.perf_counter()
    out: dict[str, Any] = {"nbytes": 0}
    for part in parts:
        link = Link(groups, kind, part)
        got = _send(name, ns, link) if link.sending else _receive(name, ns, link)
        out["nbytes"] += got.get("nbytes", 0)
        if "error" in got:
            out["error"] = got["error"]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # NCCL's copies are done when the heal says it is
    out["seconds"] = time.perf_counter() - t0
    return out


class Link:
    """The source and receivers of one part over this rank's group of ``kind``: the whole
    group by broadcast, some of its ranks by send/recv from the source. CUDA tensors go
    over the group itself, CPU tensors and objects over its gloo twin."""

    def __init__(self, groups, kind: str, part: dict):
        import torch.distributed as dist

        self.src, self.dst = part["src"], list(part["dst"])
        self.rebuild = part["rebuild"]
        self.sending = dist.get_rank() == self.src
        self.whole = set(part["group"]) == {self.src, *self.dst}
        self.pg, self.cpu = groups.get(kind), groups.cpu_group(kind)

    def obj(self, value: Any = None) -> Any:
        """The source's ``value`` on every rank of the link."""
        import torch.distributed as dist

        box = [value]
        if self.whole:
            dist.broadcast_object_list(box, src=self.src, group=self.cpu)
        elif self.sending:
            for d in self.dst:
                dist.send_object_list(box, dst=d, group=self.cpu)
        else:
            dist.recv_object_list(box, src=self.src, group=self.cpu)
        return box[0]

    def tensor(self, t) -> int:
        """Send ``t``'s bytes (source) or receive them into ``t`` (receivers); its size."""
        import torch
        import torch.distributed as dist

        if t.numel() == 0:
            return 0
        wire = t if t.is_contiguous() else t.contiguous()
        data = wire.reshape(-1).view(torch.uint8)  # any dtype over any backend
        pg = self.pg if data.is_cuda else self.cpu
        if self.whole:
            dist.broadcast(data, src=self.src, group=pg)
        elif self.sending:
            for d in self.dst:
                dist.send(data, dst=d, group=pg)
        else:
            dist.recv(data, src=self.src, group=pg)
        if wire is not t and not self.sending:
            t.copy_(wire)
        return data.numel()


def _send(name: str, ns: dict, link: Link) -> dict:
    """The source's side: the header (or why it cannot be made), then every tensor."""
    import torch

    with torch.no_grad():
        try:
            header, tensors = pack(eval(name, ns), link.rebuild)
        except Exception as e:
            why = f"rank {link.src} could not send it ({type(e).__name__}: {e})"
            if link.rebuild:  # a module that does not pickle: it must be built there
                who = ",".join(map(str, link.dst))
                why += f"; build {name} on rank {who} first, then %dist_heal {name}"
            link.obj({"error": why})
            return {"error": why}
        link.obj(header)
        sent = sum(link.tensor(t) for t in tensors)
    return {"nbytes": sent + len(header.get("pickle") or b"")}


def _receive(name: str, ns: dict, link: Link) -> dict:
    """A receiver's side: the header, then every tensor into its place (into scratch
    when the place cannot be made, so the stream stays in step), then the object is
    installed. Errors are returned, never raised half way through the stream."""
    import torch

    header = link.obj()
    if "error" in header:
        return {"error": header["error"]}
    with torch.no_grad():
        try:
            targets, install = unpack(header, name, ns, link.rebuild)
            error = None
        except Exception as e:
            targets, install = [empty_tensor(spec) for spec in header["leaves"]], None
            error = _failed(e)
        got = sum(link.tensor(t) for t in targets)
        if install is not None:
            try:
                install()
            except Exception as e:
                error = _failed(e)
    out = {"nbytes": got + len(header.get("pickle") or b"")}
    if error:
        out["error"] = error
    return out


def _failed(e: Exception) -> str:
    import torch.distributed as dist

    what = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
    return f"on rank {dist.get_rank()}, {what}"
