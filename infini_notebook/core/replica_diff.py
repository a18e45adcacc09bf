"""Which leaves differ between replicas (``%dist_diff``), from what each rank described of
its leaves (engine/replica_check.py: kind, shape, dtype, checksum, NaN/Inf). Pure.

Within each group the first rank is the reference. A row is one leaf of one group that is
not the same on every rank: missing somewhere, another shape or dtype, other values (the
tensors whose values differ are then measured on the ranks: the largest difference), or
holding NaN or Inf.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .ranks import rank_label


@dataclass
class Row:
    group: str  # "dp group 1 (ranks 1,3)"
    leaf: str
    ranks: list[int]  # the ranks that differ from the group's first (or hold NaN/Inf)
    what: str
    max_abs_diff: float | None = None


@dataclass
class Comparison:
    rows: list[Row] = field(default_factory=list)
    # leaves to measure: (group index, group ranks, paths), same shape and dtype there
    measure: list[tuple[int, list[int], list[str]]] = field(default_factory=list)
    tensors: int = 0  # tensor leaves on the groups' first ranks
    values: int = 0  # plain (non-tensor) leaves, compared by equality


def group_name(kind: str, index: int, ranks: list[int]) -> str:
    return f"{kind} group {index} ({rank_label(ranks)[1:-1]})"


def compare(leaves: dict[int, dict[str, dict]], groups: list[list[int]], kind: str) -> Comparison:
    """``leaves``: rank -> path -> description; ``groups``: the ranks that should agree."""
    out = Comparison()
    for gi, group in enumerate(groups):
        name = group_name(kind, gi, group)
        ref = leaves[group[0]]
        out.tensors += sum(1 for d in ref.values() if d["kind"] == "tensor")
        out.values += sum(1 for d in ref.values() if d["kind"] != "tensor")
        paths = list(dict.fromkeys(p for r in group for p in leaves[r]))
        to_measure = []
        for path in paths:
            row = _leaf_row(name, path, {r: leaves[r].get(path) for r in group})
            if row is None:
                continue
            out.rows.append(row)
            if row.what == "values differ":
                to_measure.append(path)
        if to_measure:
            out.measure.append((gi, group, to_measure))
    return out


def _leaf_row(group: str, path: str, found: dict[int, dict | None]) -> Row | None:
    ranks = list(found)
    missing = [r for r in ranks if found[r] is None]
    if missing:
        return Row(group, path, missing, "missing on these ranks")
    first = found[ranks[0]]
    for key, what in (("kind", "kind"), ("shape", "shape"), ("dtype", "dtype")):
        odd = [r for r in ranks[1:] if found[r].get(key) != first.get(key)]
        if odd:
            seen = ", ".join(f"{found[r].get(key)}" for r in [ranks[0], *odd])
            return Row(group, path, odd, f"{what} differs: {seen}")
    bad = [r for r in ranks if found[r].get("nan") or found[r].get("inf")]
    odd = [r for r in ranks[1:] if found[r]["sum"] != first["sum"]]
    if first["kind"] != "tensor" and odd:
        values = ", ".join(found[r]["value"] for r in [ranks[0], *odd])
        return Row(group, path, odd, f"value differs (compared by equality): {values}")
    if bad:
        words = [
            w for w, k in (("NaN", "nan"), ("Inf", "inf")) if any(found[r].get(k) for r in bad)
        ]
        return Row(group, path, bad, f"{' and '.join(words)} present")
    if odd:
        return Row(group, path, odd, "values differ")
    return None


def drop_within(rows: list[Row], atol: float) -> list[Row]:
    """Rows whose only difference is values within ``atol`` left out."""
    return [
        r
        for r in rows
        if not (r.what == "values differ" and r.max_abs_diff is not None and r.max_abs_diff <= atol)
    ]


def summary(comparison: Comparison, rows: list[Row], kind: str, ngroups: int) -> str:
    """'all 24 tensors identical across 2 dp groups', or how many leaves differ where."""
    groups = f"{ngroups} {kind} group{'s' if ngroups != 1 else ''}"
    leaves = f"{comparison.tensors // max(ngroups, 1)} tensors"
    if comparison.values:
        leaves += f" and {comparison.values // max(ngroups, 1)} other values"
    if not rows:
        return f"all {leaves} identical across {groups}"
    bad_groups = len({r.group for r in rows})
    return (
        f"{len(rows)} difference{'s' if len(rows) != 1 else ''} in {bad_groups} of {groups} "
        f"(of {leaves} each)"
    )
