"""``%dist_diff`` on a rank: the leaves of a value (tensor, module, optimizer, state dict,
nested dicts, lists and tuples), each summed up where its data lives, so that only a few
bytes per leaf reach the kernel; then, for the leaves that differ in a group, the largest
difference from the group's first rank, sent over the group itself. Runs inside each
engine; the comparison is core/replica_diff.py.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

CHUNK_WORDS = 1 << 22  # 32 MiB of int64 at a time for the on-device checksum
PRIME = (1 << 31) - 1


def leaves(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Path -> tensor or plain value: modules and optimizers by their state dicts."""
    import torch

    if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
        obj = obj.state_dict()
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    out: dict[str, Any] = {}
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            out.update(leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            out.update(leaves(value, f"{prefix}[{i}]"))
    else:
        out[prefix] = obj
    return out


def local(t):
    """A tensor's own data: a DTensor's local shard, a sparse tensor densified."""
    t = t.detach()
    to_local = getattr(t, "to_local", None)
    if callable(to_local):
        t = to_local()
    return t.to_dense() if t.is_sparse else t


def checksum(t) -> str:
    """The bytes of ``t`` summed up: SHA-1 on the CPU (the fastest of hashlib's with the
    CPU's SHA instructions: 1.5 GB/s a core here, blake2b 0.7); on a GPU two
    position-weighted sums modulo a prime, computed there (only two numbers leave it)."""
    t = local(t).contiguous()
    raw = t.reshape(-1).view(__import__("torch").uint8)
    if t.device.type == "cpu":
        return hashlib.sha1(raw.numpy(), usedforsecurity=False).hexdigest()  # no copy
    return device_checksum(raw)


def device_checksum(raw) -> str:
    """Two sums over the bytes as 32-bit words: of the words, and of each word times its
    position (so that moved values differ), both modulo 2**31 - 1."""
    import torch

    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
    plain = weighted = 0
    for start in range(0, words.numel(), CHUNK_WORDS):
        w = words[start : start + CHUNK_WORDS].to(torch.int64) & 0xFFFFFFFF
        w %= PRIME
        pos = torch.arange(start + 1, start + 1 + w.numel(), device=w.device) % PRIME
        plain = (plain + int(w.sum() % PRIME)) % PRIME
        weighted = (weighted + int(((w * pos) % PRIME).sum() % PRIME)) % PRIME
    return f"{plain:08x}{weighted:08x}-{words.numel()}"


def describe(value: Any) -> dict:
    """What the kernel compares of one leaf."""
    import torch

    if not isinstance(value, torch.Tensor):
        text = repr(value)
        digest = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
        return {"kind": "value", "value": text[:120], "sum": digest}
    t = local(value)
    info = {"kind": "tensor", "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
    info["sum"] = checksum(t)
    if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t.sum())):
        info["nan"] = bool(torch.isnan(t).any())  # one pass above; these only when it says
        info["inf"] = bool(torch.isinf(t).any())
    return info


def digests(expression: str) -> dict:
    """Each leaf of ``expression`` (evaluated in the rank's namespace) described; or why
    it cannot be: ``{"missing": "NameError: ..."}``."""
    from .bootstrap import user_namespace

    try:
        value = eval(expression, user_namespace())
    except Exception as e:
        return {"missing": f"{type(e).__name__}: {e}"}
    return {"leaves": {path: describe(v) for path, v in leaves(value).items()}}


def largest_difference(a, b) -> float:
    """max |a - b| (NaN when either holds a NaN there); booleans count 1 per mismatch."""
    import torch

    if a.numel() == 0:
        return 0.0
    if a.dtype == torch.bool:
        return float((a != b).any())
    if a.is_complex():
        return float((a - b).abs().max())
    return float((a.double() - b.double()).abs().max())


def max_diffs(expression: str, kind: str, group: list[int], paths: list[str]) -> dict[str, float]:
    """For each of ``paths`` (the same on every rank of ``group``, same shape and dtype
    there), the largest absolute difference from ``group[0]``'s value: that rank broadcasts
    each leaf over the group of ``kind`` (world: every rank) and each rank compares. A rank
    with no ``paths`` only takes part in building the kind's groups, if not built yet."""
    import torch.distributed as dist

    from .bootstrap import user_namespace

    ns = user_namespace()
    found = leaves(eval(expression, ns))
    pg = ns["groups"].get(kind)
    out = {}
    for path in paths:
        mine = local(found[path])
        theirs = mine.clone()
        dist.broadcast(theirs, src=group[0], group=pg)
        out[path] = largest_difference(mine, theirs)
    return out
