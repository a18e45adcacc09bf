"""Rank specs (``0``, ``0,2``, ``1-3``, ``all``) to rank lists and back, and ``--where``
coordinates (``pp=0,tp=1``). Pure."""

from __future__ import annotations

from .errors import DistUsageError


def parse_ranks(spec: str | int | list[int] | None, world_size: int) -> list[int]:
    """Parse a rank spec into a sorted list of distinct ranks in ``[0, world_size)``."""
    if spec is None:
        return list(range(world_size))
    if isinstance(spec, int):
        spec = str(spec)
    if isinstance(spec, (list, tuple, range)):
        ranks = sorted({int(r) for r in spec})
        _check_range(ranks, world_size, str(list(spec)))
        return ranks
    text = spec.strip().replace(" ", "")
    if text in ("all", "*", ""):
        return list(range(world_size))
    ranks: set[int] = set()
    for part in text.split(","):
        ranks.update(_parse_part(part, spec))
    out = sorted(ranks)
    _check_range(out, world_size, spec)
    return out


def parse_where(text: str) -> dict[str, int]:
    """``pp=0,tp=1`` -> ``{"pp": 0, "tp": 1}``."""
    coords = {}
    for part in filter(None, text.replace(" ", "").split(",")):
        key, sep, value = part.partition("=")
        if not sep or not value.lstrip("-").isdigit():
            raise DistUsageError(f"Bad --where {text!r}: use coordinates like pp=0 or tp=1,dp=0.")
        coords[key] = int(value)
    if not coords:
        raise DistUsageError("--where needs at least one coordinate, like pp=0.")
    return coords


def _parse_part(part: str, spec: str) -> range:
    try:
        if "-" in part:
            lo, hi = part.split("-", 1)
            a, b = int(lo), int(hi)
            if a > b:
                raise ValueError
            return range(a, b + 1)
        return range(int(part), int(part) + 1)
    except ValueError:
        raise DistUsageError(
            f"Bad rank spec {spec!r}: use ranks like '0', '0,2', '1-3' or 'all'."
        ) from None


def _check_range(ranks: list[int], world_size: int, spec: str) -> None:
    bad = [r for r in ranks if r < 0 or r >= world_size]
    if bad:
        raise DistUsageError(
            f"Rank spec {spec!r} names rank(s) {bad} but the session has ranks 0-{world_size - 1}."
        )
    if not ranks:
        raise DistUsageError(f"Rank spec {spec!r} selects no rank.")


def format_ranks(ranks: list[int]) -> str:
    """``[0,1,2,3,5]`` -> ``'0-3,5'``: the compact form used in labels."""
    rs = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(parts)


def rank_label(ranks: list[int]) -> str:
    """The label printed before a rank's output: ``[rank 2]`` or ``[ranks 0-3]``."""
    if len(ranks) == 1:
        return f"[rank {ranks[0]}]"
    return f"[ranks {format_ranks(ranks)}]"
