"""``%dist_diff`` on a rank: the leaves of a value (tensor, module, optimizer, state dict,
nested dicts, lists and tuples, objects with fields), each described in a few bytes (shape,
dtype, checksum of its data where it lives: engine/tensor_hash.py; for a DTensor, its
placements and which part this rank holds; a plain value's digest: engine/plain_values.py);
then, for the tensors and numpy arrays that differ, the largest difference from the rank
each was compared with (for an array also where), sent from that rank. The comparison is
core/replica_diff.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import plain_values
from .tensor_hash import checksum, word_dtype, words
from .tensor_leaves import largest_difference, local  # noqa: F401 (tests import them here)


def leaves(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Path -> tensor or plain value: modules and optimizers by their state dicts, dicts by
    key, lists and tuples by index, namedtuples, dataclasses and other objects with fields
    field by field (their type a leaf of its own: ``plain_values.TypeOf``)."""
    out: dict[str, Any] = {}
    _walk(obj, prefix, out, {})
    return out


def _walk(obj: Any, path: str, out: dict[str, Any], inside: dict[int, str]) -> None:
    """``obj``'s leaves into ``out``; ``inside``: the containers it is in, by id, with their
    paths (a field that refers back to one is a ``Reference``, not a walk without end)."""
    import torch

    if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
        obj = obj.state_dict()
    if isinstance(obj, torch.Tensor) or plain_values.generator_state(obj) is not None:
        out[path] = obj
        return
    dot = f"{path}." if path else ""
    if isinstance(obj, Mapping):
        items = [(dot + _key(k), v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple)) and not hasattr(type(obj), "_fields"):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    else:
        found = plain_values.fields(obj)
        if not found:  # a plain value, or an object with no fields
            out[path] = obj
            return
        items = [(dot + name, v) for name, v in found]
    if id(obj) in inside:
        out[path] = plain_values.Reference(inside[id(obj)])
        return
    if not isinstance(obj, (Mapping, list, tuple)) or hasattr(type(obj), "_fields"):
        out[path] = plain_values.TypeOf(obj)
    inside[id(obj)] = path
    for at, value in items:
        _walk(value, at, out, inside)
    del inside[id(obj)]


def _key(key: Any) -> str:
    """A dict key in a path: itself, a set's elements in a sorted order."""
    return plain_values.show(key) if isinstance(key, (set, frozenset)) else str(key)


def placement(t) -> dict:
    """A DTensor's layout (its placements over its mesh) and the part of it this rank holds:
    its coordinates along the mesh dims that are not Replicate (empty: the whole tensor).
    Ranks with the same layout and part hold the same values. {} for other tensors.
    torch 2.13: ``DTensor.placements``, ``DTensor.device_mesh`` (torch/distributed/tensor/
    _api.py), ``Placement.is_replicate()`` (torch/_C/_distributed.pyi),
    ``DeviceMesh.get_coordinate()`` / ``.shape`` / ``.mesh_dim_names`` (device_mesh.py)."""
    placements = getattr(t, "placements", None)
    if placements is None:
        return {}
    mesh = t.device_mesh
    names = mesh.mesh_dim_names or [f"dim{i}" for i in range(mesh.ndim)]
    coords = mesh.get_coordinate()
    over = ", ".join(f"{n}={s}" for n, s in zip(names, mesh.shape))
    part = [f"{n}={c}" for n, c, p in zip(names, coords, placements) if not p.is_replicate()]
    return {
        "layout": f"{', '.join(map(repr, placements))} over {over}",
        "part": ", ".join(part),
    }


def nan_inf(t) -> dict:
    """Whether a floating tensor holds NaN or Inf: one pass (a sum) where torch can sum the
    dtype, the exact checks only when it says so. Formats named ``fn`` (finite numbers:
    float8_e4m3fn, float4_e2m1fn_x2, ...) have no Inf, and torch no isinf for them."""
    import torch

    if not (t.is_floating_point() or t.is_complex()) or t.device.type == "meta":
        return {}
    summable = t.element_size() > 1 and t.dtype != torch.complex32
    if summable and bool(torch.isfinite(t.sum())):
        return {}
    nan = _any(torch.isnan, t)
    inf = "fn" not in str(t.dtype) and _any(torch.isinf, t)
    return {"nan": nan, "inf": inf}


def _any(check, t) -> bool:
    """``check(t).any()``; through float32 where the device lacks the kernel for the dtype
    (isinf on CUDA float8_e5m2 needs abs, which CUDA does not implement for it: seen on an
    H100, torch 2.11). The cast keeps NaN and Inf."""
    try:
        return bool(check(t).any())
    except (NotImplementedError, RuntimeError):
        return bool(check(t.float()).any())


def describe(value: Any) -> dict:
    """What the kernel compares of one leaf."""
    import torch

    if not isinstance(value, torch.Tensor):
        return plain_values.describe(value)
    t = local(value)
    return {
        "kind": "tensor",
        "shape": list(value.shape),  # a DTensor's: the whole tensor's
        "dtype": str(value.dtype).replace("torch.", ""),
        "device": t.device.type,
        "sum": checksum(t),
        **nan_inf(t),
        **placement(value),
    }


def digests(expression: str) -> dict:
    """Each leaf of ``expression`` (evaluated in the rank's namespace) described; or why
    it cannot be: ``{"missing": "NameError: ..."}``."""
    from .bootstrap import user_namespace

    try:
        value = eval(expression, user_namespace())
    except Exception as e:
        return {"missing": f"{type(e).__name__}: {e}"}
    return {"leaves": {path: describe(v) for path, v in leaves(value).items()}}


def max_diffs(expression: str, transfers: list[tuple[str, int, int, bool]], cpu: bool) -> dict:
    """``measure`` for the leaves of ``expression`` in the rank's namespace, over its
    ``groups``."""
    from .bootstrap import user_namespace

    ns = user_namespace()
    found = leaves(eval(expression, ns)) if transfers else {}
    return measure(found, transfers, ns["groups"], cpu)


def measure(found: dict, transfers: list[tuple[str, int, int, bool]], groups, cpu: bool) -> dict:
    """For each ``(path, src, dst, on_cpu)`` in order: ``src`` sends its leaf (as bytes, so
    that any dtype goes over any backend) to ``dst``, which measures the largest difference
    from its own. Returns ``{path: difference}`` for the leaves this rank received.

    Every rank calls this, each with its own transfers in the order of one list, so the
    blocking sends and receives cannot deadlock. CPU leaves go over the gloo twin of the
    world group (``groups.cpu_group``); ``cpu`` (the same on every rank) gets it first,
    which builds it on a backend that is not gloo: a collective of every rank."""
    import torch
    import torch.distributed as dist

    twin = groups.cpu_group("world") if cpu else None
    out = {}
    for path, src, dst, on_cpu in transfers:
        leaf = found[path]
        array = not isinstance(leaf, torch.Tensor)  # a numpy array
        mine = leaf if array else local(leaf)
        payload = _array_payload(leaf) if array else as_bytes(mine)
        pg = None
        if on_cpu or groups.backend == "gloo":
            payload, pg = payload.cpu(), twin
        if dist.get_rank() == src:
            dist.send(payload, dst, group=pg)
            continue
        got = torch.empty_like(payload)
        dist.recv(got, src, group=pg)
        if array:
            theirs = got.numpy().view(leaf.dtype).reshape(leaf.shape)
            out[path] = plain_values.array_difference(leaf, theirs)
        else:
            out[path] = largest_difference(mine, from_bytes(got.to(mine.device), mine))
    return out


def _array_payload(a):
    """A numpy array's bytes as a uint8 tensor (a copy: the array may be read-only)."""
    import torch

    return torch.from_numpy(plain_values.array_bytes(a).copy())


def as_bytes(t):
    """``t``'s data as flat bytes: any dtype goes over any backend so."""
    import torch

    return words(t).view(torch.uint8)


def from_bytes(data, like):
    """Bytes from ``as_bytes`` back to a tensor of ``like``'s dtype and shape."""
    return data.view(word_dtype(like)).view(like.dtype).reshape(like.shape)
