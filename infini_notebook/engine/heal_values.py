"""``%dist_heal`` on a rank: the values a name can hold (its kind, its tensors, a DTensor's
local tensor) and how one is sent (``pack``: a small header and the tensors to stream) and
where it lands (``unpack``: in place in the receiver's own object, or a new one built from
the header); a module travels pickled without its tensors' data. The transfer itself is
engine/heal.py's."""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any


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


@dataclass(frozen=True)
class Slot:
    """Where a tensor of an optimizer's state was, in the header: its index in the stream,
    and a DTensor's placements, shape and stride (None for a plain tensor)."""

    index: int
    dtensor: tuple | None = None


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
        targets = [empty_tensor(spec) for spec in header["leaves"]]
        opt = eval(name, ns)
        return targets, lambda: _load_optimizer(opt, header, targets)
    if kind == "tensor" and not rebuild:
        targets = [local(eval(name, ns))]
        _check_fit(targets, header["leaves"], name)
        return targets, None
    if kind == "tensor":
        targets = [empty_tensor(header["leaves"][0])]
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


def empty_tensor(spec: tuple):
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
