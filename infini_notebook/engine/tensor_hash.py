"""Checksums of a tensor's data for ``%dist_diff``, written once in torch ops, so that the
code the CPU tests run is the code that runs on a GPU.

A tensor's elements are read as the integers of their bits (``words``: any dtype, any
view). On a GPU each word is hashed with its position (murmur3's 64-bit finalizer, twice)
and the hashes are summed modulo 2**64 (``device_checksum``): 8 bytes leave the device, a
changed, moved, sign-flipped or bit-flipped element changes the sum but for a chance of
about 2**-64. On the CPU, SHA-1 of the same words is five times faster than those ops
(the CPU's SHA instructions), so ``checksum`` uses it there; both read the same words.
"""

from __future__ import annotations

import hashlib

CHUNK_WORDS = 1 << 22  # 32 MiB of int64 at a time on the device
_M32 = (1 << 32) - 1
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # constants as signed int64: torch has no uint64 math
_C1 = 0xFF51AFD7ED558CCD - (1 << 64)
_C2 = 0xC4CEB9FE1A85EC53 - (1 << 64)


def word_dtype(t):
    """The integer dtype as wide as ``t``'s elements (int64 for 16-byte complex)."""
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32}.get(t.element_size(), torch.int64)


def words(t):
    """The elements of ``t`` (dense, not quantized) as flat integers of the same bits: one
    per element of 1, 2, 4 or 8 bytes, two int64 per 16-byte complex. A view with any
    storage offset works: the integers are as wide as the elements. Conjugate and negative
    views are resolved first (torch refuses to view them as another dtype)."""
    t = t.resolve_conj().resolve_neg()
    if t.element_size() > 8:
        t = t.reshape(-1).contiguous()  # viewing as narrower words needs stride 1
    return t.view(word_dtype(t)).reshape(-1).contiguous()


def _mix(x):
    """murmur3's fmix64 on int64 (multiplication wraps modulo 2**64 on CPU and CUDA; the
    masks make the arithmetic right shifts logical)."""
    x = x ^ ((x >> 33) & ((1 << 31) - 1))
    x = x * _C1
    x = x ^ ((x >> 33) & ((1 << 31) - 1))
    x = x * _C2
    return x ^ ((x >> 33) & ((1 << 31) - 1))


def word_hashes(w, start: int = 0):
    """A 64-bit hash of each word along the last dim and its position there (``start`` +
    index): bijective in the word for a given position, so a single changed word always
    changes the sum."""
    import torch

    pos = torch.arange(start, start + w.shape[-1], device=w.device, dtype=torch.int64)
    return _mix(w.to(torch.int64) ^ _mix(pos + _GOLDEN))


def hash_sums(w, start: int = 0) -> list[int]:
    """For each row of ``w`` (its last dim, shorter than 2**31 words), the sum of its word
    hashes modulo 2**64, summed exactly in two 32-bit halves."""
    h = word_hashes(w, start)
    lo = (h & _M32).sum(-1).reshape(-1).tolist()
    hi = ((h >> 32) & _M32).sum(-1).reshape(-1).tolist()
    return [(a + (b << 32)) % (1 << 64) for a, b in zip(lo, hi)]


def device_checksum(w) -> str:
    """The sum of the hashes of the flat words ``w``, computed where they live, a chunk at
    a time; only the two halves of each chunk's sum leave the device."""
    total = 0
    for start in range(0, w.numel(), CHUNK_WORDS):
        total += hash_sums(w[start : start + CHUNK_WORDS], start)[0]
    return f"{total % (1 << 64):016x}-{w.numel()}"


def checksum(t) -> str:
    """``t``'s data summed up: SHA-1 of its words on the CPU (no copy for a contiguous
    tensor), ``device_checksum`` elsewhere."""
    if t.device.type == "meta":
        return "meta (no data)"
    w = words(t)
    if t.device.type == "cpu":
        return hashlib.sha1(w.numpy(), usedforsecurity=False).hexdigest()
    return device_checksum(w)
