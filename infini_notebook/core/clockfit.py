"""How far to move each rank's clock so that collectives end together (pure).

The same collective ends at about the same moment on all its members, so with each rank's
clock moved by ``d[r]`` the ends ``t[c][r] + d[r]`` should agree. The fit is the least
squares one: minimise sum over collectives c and members r of (t[c][r] + d[r] - m[c])^2,
m[c] the members' mean; one rank (the reference) stays where it is, since the ends only
say where the ranks are relative to each other, and every other rank moves at most its
bound (where its store sample puts its clock). Solved exactly, one rank at a time with the
others held (Gauss-Seidel on the normal equations, clamped to the bounds): each step can
only lower a convex objective, so it converges, and unlike moving every rank at once by its
median gap it never overshoots (two ranks 300 µs apart do not swap places).

A second pass leaves out the collectives whose ends stay far apart after the first
(a gloo worker thread that woke late on a busy machine), then fits again.
"""

from __future__ import annotations

import statistics

MAX_SWEEPS = 500
TOLERANCE_US = 1e-4
OUTLIER_FACTOR = 5.0
OUTLIER_FLOOR_US = 50.0


def fit(ends: list[dict[int, float]], bounds: dict[int, float], reference: int) -> dict[int, float]:
    """``ends``: per collective, {rank: its end on that rank's clock (µs)}; ``bounds``: how
    far each rank may move (µs). Returns {rank: correction (µs)}, 0 for the reference and
    for ranks that share no collective with the others."""
    shared = [c for c in ends if len(c) > 1]
    d = _solve(shared, bounds, reference)
    residuals = [max(abs(_residual(c, d, r)) for r in c) for c in shared]
    if len(residuals) > 2:
        limit = max(OUTLIER_FLOOR_US, OUTLIER_FACTOR * statistics.median(residuals))
        kept = [c for c, res in zip(shared, residuals) if res <= limit]
        if len(kept) < len(shared) and kept:
            d = _solve(kept, bounds, reference)
    return d


def _residual(c: dict[int, float], d: dict[int, float], r: int) -> float:
    mean = statistics.fmean(t + d.get(s, 0.0) for s, t in c.items())
    return c[r] + d.get(r, 0.0) - mean


def _solve(ends: list[dict[int, float]], bounds: dict[int, float], reference: int):
    """The normal equations, one rank at a time: for rank r, with the others held,
    sum over its collectives of (t[c][r] + d[r] - m[c]) = 0 gives
    d[r] = (K[r] + sum_s W[r][s] d[s]) / D[r], where D[r] = sum (1 - 1/n_c),
    W[r][s] = sum over collectives of both (1/n_c), K[r] = sum (mean_c(t) - t[c][r])."""
    ranks = sorted({r for c in ends for r in c} | {reference})
    diag = {r: 0.0 for r in ranks}
    const = {r: 0.0 for r in ranks}
    weight: dict[int, dict[int, float]] = {r: {} for r in ranks}
    for c in ends:
        n = len(c)
        base = next(iter(c.values()))  # each collective's ends near 0: float precision
        mean = statistics.fmean(t - base for t in c.values())
        for r, t in c.items():
            diag[r] += 1 - 1 / n
            const[r] += mean - (t - base)
            for s in c:
                if s != r:
                    weight[r][s] = weight[r].get(s, 0.0) + 1 / n
    d = {r: 0.0 for r in ranks}
    for _ in range(MAX_SWEEPS):
        moved = 0.0
        for r in ranks:
            if r == reference or diag[r] == 0:
                continue
            value = (const[r] + sum(w * d[s] for s, w in weight[r].items())) / diag[r]
            bound = bounds.get(r, float("inf"))
            value = max(-bound, min(bound, value))
            moved = max(moved, abs(value - d[r]))
            d[r] = value
        if moved < TOLERANCE_US:
            break
    return d
