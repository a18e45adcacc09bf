"""Time on a timeline as unions of intervals (pure). A rank's profile splits its window into
parts that never overlap, so that they add up to the window: each part is a union of
intervals, less the parts before it."""

from __future__ import annotations

Span = tuple[float, float]


def union(spans) -> list[Span]:
    """The union of ``spans`` as sorted, disjoint intervals (empty ones dropped)."""
    out: list[list[float]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def length(spans) -> float:
    """Total length of the union of ``spans``."""
    return sum(b - a for a, b in union(spans))


def clip(spans, lo: float, hi: float) -> list[Span]:
    """``spans`` cut to the window [lo, hi]."""
    return [(max(a, lo), min(b, hi)) for a, b in spans if min(b, hi) > max(a, lo)]


def subtract(spans, cut) -> list[Span]:
    """The union of ``spans`` less the union of ``cut``."""
    out, cut = [], union(cut)
    i = 0
    for a, b in union(spans):
        while i < len(cut) and cut[i][1] <= a:
            i += 1
        j, start = i, a
        while j < len(cut) and cut[j][0] < b:
            if cut[j][0] > start:
                out.append((start, cut[j][0]))
            start = max(start, cut[j][1])
            j += 1
        if start < b:
            out.append((start, b))
    return out


def partition(lo: float, hi: float, layers: list[list[Span]]) -> list[float]:
    """How much of [lo, hi] each layer takes, earlier layers first (a moment two layers
    cover counts for the earlier), and what none takes last: the parts add up to hi - lo."""
    taken: list[Span] = []
    parts = []
    for spans in layers:
        own = subtract(clip(spans, lo, hi), taken)
        parts.append(sum(b - a for a, b in own))
        taken = union(taken + own)
    parts.append(max(0.0, (hi - lo) - sum(parts)))
    return parts
