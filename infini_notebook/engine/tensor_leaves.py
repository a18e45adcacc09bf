"""A tensor leaf's own data and how far two leaves differ: what the replica diff
(replica_check.py) and the plain values' digest (plain_values.py) both need. Runs inside
a rank."""

from __future__ import annotations


def local(t):
    """A tensor's own data: a DTensor's local shard, a sparse tensor densified, a quantized
    one's values (its integers alone would call tensors of another scale identical), a
    conjugate or negative view resolved (such views cannot be viewed as other dtypes)."""
    import torch

    t = t.detach()
    to_local = getattr(t, "to_local", None)
    if callable(to_local):
        t = to_local()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_quantized:
        try:
            return t.dequantize()
        except RuntimeError:  # sub-byte quantized types have no dequantize kernel here
            return t.int_repr()
    return t.resolve_conj().resolve_neg()


def largest_difference(a, b) -> float | int | None:
    """max |a - b|: exact for integers (an int64 difference past 2**53 does not round to
    0), NaN where one holds a NaN and the other not (NaN on both at one place counts 0), 1
    for booleans that differ; None for dtypes torch has no arithmetic for (bits, sub-byte
    integers, float4 pairs)."""
    import torch

    if a.numel() == 0:
        return 0
    if a.dtype == torch.bool:
        return float((a != b).any())
    try:
        if a.is_complex():
            return float((a.to(torch.complex128) - b.to(torch.complex128)).abs().max())
        if a.is_floating_point():  # a NaN on both at one place is no difference there
            a, b = a.double(), b.double()
            return float((a - b).abs().masked_fill(a.isnan() & b.isnan(), 0).max())
        if a.element_size() < 8:
            return int((a.long() - b.long()).abs().max())
    except NotImplementedError:
        return None
    # 64-bit integers, in int64 order (uint64's with the top bit flipped): the larger less
    # the smaller wraps past 2**63, and read unsigned it is exact.
    flip = -(1 << 63) if a.dtype == torch.uint64 else 0
    a, b = a.view(torch.int64) ^ flip, b.view(torch.int64) ^ flip
    d = a.maximum(b) - a.minimum(b)
    wrapped = d[d < 0]
    return int(wrapped.max()) + (1 << 64) if wrapped.numel() else int(d.max())
