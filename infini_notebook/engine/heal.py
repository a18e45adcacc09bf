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

import io
import pickle
import time
from dataclasses import dataclass
from typing import Any

from .bootstrap import user_namespace


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


def kind_of(obj) -> str:
    import torch

    if isinstance(obj, torch.nn.Module):
        return "module"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, torch.Tensor):
        return "tensor"
    return "value"


def module_tensors(module) -> list[tuple[str, Any]]:
    """A module's parameters, then its buffers, each once (tied weights once)."""
    seen, out = set(), []
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


def is_dtensor(t) -> bool:
    return hasattr(t, "placements") and hasattr(t, "device_mesh")


def local(t):
    """The tensor whose memory holds ``t``'s data on this rank, detached: writing into it
    writes ``t``. Call under ``torch.no_grad()``: torch 2.13's ``DTensor.to_local`` then
    returns ``self._local_tensor`` itself (torch/distributed/tensor/_api.py), not a copy."""
    if is_dtensor(t):
        t = t.to_local()
    return t.detach()


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


def session_mesh(ns: dict, dims: list[str] | None):
    """The session's ``mesh`` sliced to ``dims`` (``mesh["tp"]``), or None."""
    whole = ns.get("mesh")
    names = getattr(whole, "mesh_dim_names", None)
    if not dims or not names or not set(dims) <= set(names):
        return None
    try:
        return whole if list(dims) == list(names) else whole[tuple(dims)]
    except Exception:
        return None


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
@dataclass(frozen=True)
class Slot:
    """Where a tensor of an optimizer's state was, in the header: its index in the stream,
    and a DTensor's placements, shape and stride (None for a plain tensor)."""

    index: int
    dtensor: tuple | None = None


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
            targets, install = [_empty(spec) for spec in header["leaves"]], None
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


# ----- what is sent, and where it lands --------------------------------------------------------
def pack(obj, rebuild: bool) -> tuple[dict, list]:
    """The header and the tensors to stream, in order. A leaf spec: (shape, dtype, device
    type)."""
    kind = kind_of(obj)
    if kind == "module":
        if rebuild:
            blob, storages = pickle_module(obj)
            tensors = [_storage_bytes(s) for s in storages]
        else:
            blob, tensors = None, [local(t) for _, t in module_tensors(obj)]
        header = {"kind": kind, "pickle": blob, "names": [n for n, _ in module_tensors(obj)]}
    elif kind == "optimizer":
        sd = obj.state_dict()
        tensors = []
        header = {
            "kind": kind,
            "state": _strip(sd["state"], tensors),
            "param_groups": sd["param_groups"],
        }
    elif kind == "tensor":
        tensors = [local(obj)]
        header = {
            "kind": kind,
            "requires_grad": obj.requires_grad,
            "parameter": type(obj).__name__ == "Parameter",
            "dtensor": _dtensor_spec(obj) if is_dtensor(obj) else None,
        }
    else:
        header = {"kind": kind, "pickle": pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)}
        tensors = []
    header["leaves"] = [_spec(t) for t in tensors]
    return header, tensors


def unpack(header: dict, name: str, ns: dict, rebuild: bool):
    """(tensors to receive into, in the stream's order; the function that installs the
    object afterwards). Raises when the receiver's object does not fit the header."""
    kind = header["kind"]
    if kind == "module" and rebuild:
        module, storages = _defined_here(name, unpickle_module, header["pickle"])
        return [_storage_bytes(s) for s in storages], lambda: bind(ns, name, module)
    if kind == "module":
        mine = dict(module_tensors(eval(name, ns)))
        targets = [local(mine[n]) for n in header["names"]]
        _check_fit(targets, header["leaves"], name)
        return targets, None
    if kind == "optimizer":
        targets = [_empty(spec) for spec in header["leaves"]]
        opt = eval(name, ns)
        return targets, lambda: _load_optimizer(opt, header, targets)
    if kind == "tensor" and not rebuild:
        targets = [local(eval(name, ns))]
        _check_fit(targets, header["leaves"], name)
        return targets, None
    if kind == "tensor":
        targets = [_empty(header["leaves"][0])]
        return targets, lambda: bind(ns, name, _new_tensor(targets[0], header, ns))
    return [], lambda: bind(ns, name, _defined_here(name, pickle.loads, header["pickle"]))


def _defined_here(name: str, loads, blob: bytes):
    """``loads(blob)``, or why not in a sentence with the way on: a class defined in a
    notebook cell (``__main__``) is unknown to a new rank until that cell runs there."""
    import torch.distributed as dist

    try:
        return loads(blob)
    except (AttributeError, ImportError) as e:
        raise RuntimeError(
            f"{e}: run the cell that defines it on rank {dist.get_rank()} first "
            f"(%%dist --ranks {dist.get_rank()}), then %dist_heal {name}"
        ) from None


def bind(ns: dict, name: str, value) -> None:
    """``name = value`` in the rank's namespace (``a.b = value`` for a dotted name)."""
    owner, _, attr = name.rpartition(".")
    if owner:
        setattr(eval(owner, ns), attr, value)
    else:
        ns[name] = value


def _spec(t) -> tuple:
    return (tuple(t.shape), t.dtype, t.device.type)


def _device(device_type: str):
    """This rank's device of a type the source named (its own GPU for 'cuda')."""
    import torch

    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def _empty(spec: tuple):
    import torch

    shape, dtype, device_type = spec
    return torch.empty(shape, dtype=dtype, device=_device(device_type))


def _check_fit(targets: list, specs: list, name: str) -> None:
    for t, (shape, dtype, _) in zip(targets, specs):
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
            raise ValueError(
                f"{name} holds a {dtype} tensor of shape {list(shape)} on the source, "
                f"{t.dtype} {list(t.shape)} here"
            )


def _dtensor_spec(t) -> tuple:
    """What a receiver needs to wrap a local tensor as ``t`` is wrapped: placements,
    global shape and stride, and the mesh's dim names (for a top-level DTensor)."""
    names = list(t.device_mesh.mesh_dim_names or [])
    return (tuple(t.placements), tuple(t.shape), tuple(t.stride()), names)


def _new_tensor(data, header: dict, ns: dict):
    """A receiver's new tensor: a DTensor on the session's mesh (sliced by the source's
    dim names) when the source's was one, a Parameter when it was one."""
    import torch

    value = data
    if header["dtensor"] is not None:
        from torch.distributed.tensor import DTensor

        placements, shape, stride, names = header["dtensor"]
        mesh = session_mesh(ns, names)
        value = DTensor.from_local(
            data, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride
        )
    if header["parameter"]:
        return torch.nn.Parameter(value, requires_grad=header["requires_grad"])
    return value.requires_grad_(header["requires_grad"]) if value.is_floating_point() else value


def _strip(value, tensors: list):
    """An optimizer's state with each tensor replaced by its ``Slot`` (appended to
    ``tensors``, DTensors by their local tensor)."""
    import torch

    if isinstance(value, torch.Tensor):
        spec = None
        if is_dtensor(value):
            spec = (tuple(value.placements), tuple(value.shape), tuple(value.stride()))
        tensors.append(local(value))
        return Slot(len(tensors) - 1, spec)
    if isinstance(value, dict):
        return {k: _strip(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_strip(v, tensors) for v in value)
    return value


def _fill(value, tensors: list, param):
    """``_strip`` undone on the receiver: its received tensors in the slots, DTensors
    wrapped on the mesh of the receiver's own parameter."""
    import torch

    if isinstance(value, Slot):
        t = tensors[value.index]
        if value.dtensor is None:
            return t
        from torch.distributed.tensor import DTensor

        placements, shape, stride = value.dtensor
        return DTensor.from_local(
            t, param.device_mesh, placements, run_check=False, shape=torch.Size(shape),
            stride=stride,
        )  # fmt: skip
    if isinstance(value, dict):
        return {k: _fill(v, tensors, param) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_fill(v, tensors, param) for v in value)
    return value


def _load_optimizer(opt, header: dict, tensors: list) -> None:
    """The source's state and hyperparameters loaded into the receiver's optimizer (its
    state's keys are positions among its parameters, as in ``state_dict``)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    state = {k: _fill(v, tensors, params[k]) for k, v in header["state"].items()}
    opt.load_state_dict({"state": state, "param_groups": header["param_groups"]})


# ----- a module pickled without its tensors' data -------------------------------------------
class _Pickler(pickle.Pickler):
    """Pickles a module with every tensor storage replaced by a placeholder (its index,
    size, dtype and device type); the storages are streamed apart, in that order."""

    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.storages: list = []
        self._index: dict[tuple, int] = {}

    def persistent_id(self, obj):
        import torch

        if isinstance(obj, torch.storage.TypedStorage):
            storage, dtype = obj._untyped_storage, obj.dtype
        elif isinstance(obj, torch.UntypedStorage):
            storage, dtype = obj, None
        else:
            return None
        key = (storage.device.type, storage.data_ptr(), storage.nbytes())
        if key not in self._index:
            self._index[key] = len(self.storages)
            self.storages.append(storage)
        return ("storage", self._index[key], storage.nbytes(), dtype, storage.device.type)


class _Unpickler(pickle.Unpickler):
    """The placeholders of ``_Pickler`` back as empty storages on this rank's device."""

    def __init__(self, file):
        super().__init__(file)
        self.storages: list = []

    def persistent_load(self, pid):
        import torch

        _, index, nbytes, dtype, device_type = pid
        while len(self.storages) <= index:
            self.storages.append(None)
        if self.storages[index] is None:
            self.storages[index] = torch.UntypedStorage(nbytes, device=_device(device_type))
        storage = self.storages[index]
        if dtype is None:
            return storage
        return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)


def pickle_module(module) -> tuple[bytes, list]:
    """(the module pickled without its tensors' data, its storages in placeholder order)."""
    f = io.BytesIO()
    p = _Pickler(f)
    p.dump(module)
    return f.getvalue(), p.storages


def unpickle_module(blob: bytes) -> tuple[Any, list]:
    """(the module on empty storages, those storages in placeholder order)."""
    u = _Unpickler(io.BytesIO(blob))
    module = u.load()
    return module, u.storages


def _storage_bytes(storage):
    """A storage's bytes as a uint8 tensor (the storage itself, not a copy)."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
