"""Which leaves differ between replicas (``%dist_diff``), from what each rank described of
its leaves (engine/replica_check.py: kind, shape, dtype, device, checksum, NaN/Inf, and for
a DTensor its layout and the part it holds). Pure.

Within each group a rank is compared with a reference: for a plain tensor or value the
group's first rank; for a DTensor the group's first rank that holds the same part (the same
coordinates along the mesh dims where it is not Replicate), so that shards are never
compared with other shards. Where a group holds each part of a DTensor once (sharded over
the whole group, as FSDP2 over dp), the group's whole tensor is compared with the first
group's, part by part. A row is one leaf of one group that is not the same on every rank:
missing somewhere, another shape, dtype or layout, other values (the tensors whose values
differ are then measured on the ranks: ``transfers``), or holding NaN or Inf.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .ranks import rank_label


@dataclass
class Row:
    group: str  # "dp group 1 (ranks 1,3)"
    leaf: str
    ranks: list[int]  # the ranks that differ from their reference (or hold NaN/Inf)
    what: str
    max_abs_diff: float | None = None


@dataclass
class Comparison:
    rows: list[Row] = field(default_factory=list)
    # values to measure, in this order: (leaf, reference rank, rank, over the CPU)
    transfers: list[tuple[str, int, int, bool]] = field(default_factory=list)
    tensors: set[str] = field(default_factory=set)  # tensor leaves
    values: set[str] = field(default_factory=set)  # plain leaves, compared by equality
    # DTensor leaves by how they were compared: "parts" (ranks of a group holding the same
    # part), "groups" (each group's whole tensor against the first group's), "once" (one
    # copy in all: nothing to compare)
    dtensors: dict[str, str] = field(default_factory=dict)


def group_name(kind: str, index: int, ranks: list[int]) -> str:
    return f"{kind} group {index} ({rank_label(ranks)[1:-1]})"


def unreadable(expression: str, why: dict[int, str]) -> str:
    """One line per distinct error, with the ranks it came from."""
    ranks: dict[str, list[int]] = {}
    for r, message in sorted(why.items()):
        ranks.setdefault(message, []).append(r)
    where = "; ".join(f"{rank_label(rs)[1:-1]}: {message}" for message, rs in ranks.items())
    return f"{expression!r} cannot be read on every rank ({where})."


def compare(leaves: dict[int, dict[str, dict]], groups: list[list[int]], kind: str) -> Comparison:
    """``leaves``: rank -> path -> description; ``groups``: the ranks that should agree."""
    out = Comparison()
    first_copy: dict[str, dict[tuple, tuple[int, str]]] = {}  # path -> part -> (rank, group)
    for gi, group in enumerate(groups):
        name = group_name(kind, gi, group)
        for path in dict.fromkeys(p for r in group for p in leaves[r]):
            found = {r: leaves[r].get(path) for r in group}
            row = _mismatch(name, path, found)
            first = found[group[0]]
            if first is not None:
                (out.tensors if first["kind"] == "tensor" else out.values).add(path)
            if row is None and first["kind"] == "tensor":
                against, how = _references(found, name, first_copy.setdefault(path, {}))
                if how:
                    _note(out.dtensors, path, how, bool(against))
                row = _values_row(name, path, leaves, against)
                for r in row.ranks if row else []:
                    ref = against[r][0]
                    on_cpu = "cpu" in (leaves[r][path]["device"], leaves[ref][path]["device"])
                    out.transfers.append((path, ref, r, on_cpu))
            if row is not None:
                out.rows.append(row)
    return out


def _mismatch(group: str, path: str, found: dict[int, dict | None]) -> Row | None:
    """A row for a leaf missing somewhere, of another kind, shape, dtype or layout, a plain
    value that differs, or a tensor holding NaN or Inf; None when none of these."""
    ranks = list(found)
    missing = [r for r in ranks if found[r] is None]
    if missing:
        return Row(group, path, missing, "missing on these ranks")
    first = found[ranks[0]]
    for key in ("kind", "shape", "dtype", "layout"):
        odd = [r for r in ranks[1:] if found[r].get(key) != first.get(key)]
        if odd:
            seen = ", ".join(f"{found[r].get(key)}" for r in [ranks[0], *odd])
            return Row(group, path, odd, f"{key} differs: {seen}")
    if first["kind"] != "tensor":
        odd = [r for r in ranks[1:] if found[r]["sum"] != first["sum"]]
        if odd:
            values = ", ".join(found[r]["value"] for r in [ranks[0], *odd])
            return Row(group, path, odd, f"value differs (compared by equality): {values}")
        return None
    bad = [r for r in ranks if found[r].get("nan") or found[r].get("inf")]
    if bad:
        words = [
            w for w, k in (("NaN", "nan"), ("Inf", "inf")) if any(found[r].get(k) for r in bad)
        ]
        return Row(group, path, bad, f"{' and '.join(words)} present")
    return None


def _references(
    found: dict[int, dict], group: str, first_copy: dict[tuple, tuple[int, str]]
) -> tuple[dict[int, tuple[int, str]], str | None]:
    """Each rank's reference ``(rank, group name)``, for the ranks that have one, and how a
    DTensor was compared (None for a plain tensor)."""
    holders: dict[str | None, list[int]] = {}
    for r, d in found.items():
        holders.setdefault(d.get("part"), []).append(r)
    dtensor = None not in holders
    if not dtensor or any(len(rs) > 1 for rs in holders.values()):
        against = {r: (rs[0], group) for rs in holders.values() for r in rs[1:]}
        return against, "parts" if dtensor else None
    against = {}
    for r, d in found.items():  # each part held once here: the first group's copy decides
        key = (d["layout"], tuple(d["shape"]), d["dtype"], d["part"])
        if key in first_copy:
            against[r] = first_copy[key]
        else:
            first_copy[key] = (r, group)
    return against, "groups"


def _note(dtensors: dict[str, str], path: str, how: str, compared: bool) -> None:
    """How a DTensor leaf was compared, over all groups: by parts where any group holds a
    part twice, else by groups where any group had another's copy to compare with."""
    now = dtensors.get(path)
    if how == "parts" or now == "parts":
        dtensors[path] = "parts"
    elif compared or now == "groups":
        dtensors[path] = "groups"
    else:
        dtensors[path] = "once"


def _values_row(
    group: str, path: str, leaves: dict[int, dict[str, dict]], against: dict[int, tuple[int, str]]
) -> Row | None:
    odd = [
        r for r, (ref, _) in against.items() if leaves[r][path]["sum"] != leaves[ref][path]["sum"]
    ]
    if not odd:
        return None
    others = sorted({g for r, (_, g) in against.items() if r in odd and g != group})
    return Row(
        group, path, sorted(odd), " ".join(["values differ", *(f"from {g}" for g in others)])
    )


def drop_within(rows: list[Row], atol: float) -> list[Row]:
    """Rows whose only difference is values within ``atol`` left out."""
    return [
        r
        for r in rows
        if not (
            r.what.startswith("values differ")
            and r.max_abs_diff is not None
            and r.max_abs_diff <= atol
        )
    ]


def summary(comparison: Comparison, rows: list[Row], kind: str, ngroups: int) -> str:
    """'all 24 tensors identical across 2 dp groups', or how many leaves differ where; and,
    for DTensors, what was compared."""
    groups = f"{ngroups} {kind} group{'s' if ngroups != 1 else ''}"
    how = list(comparison.dtensors.values())
    compared = len(comparison.tensors) - how.count("once")
    leaves = f"{compared} tensors"
    if comparison.values:
        leaves += f" and {len(comparison.values)} other values"
    if rows:
        bad_groups = len({r.group for r in rows})
        s = "s" if len(rows) != 1 else ""
        line = f"{len(rows)} difference{s} in {bad_groups} of {groups} (of {leaves} each)"
    elif compared or comparison.values:
        line = f"all {leaves} identical across {groups}"
    else:
        line = f"nothing to compare across {groups}"
    notes = []
    if how.count("parts"):
        notes.append(f"{how.count('parts')} DTensors compared between ranks holding the same part")
    if how.count("groups"):
        notes.append(
            f"{how.count('groups')} DTensors sharded over each {kind} group: each group's whole "
            "tensor compared with the first group's"
        )
    if how.count("once"):
        notes.append(f"{how.count('once')} DTensors with each part on one rank only: not compared")
    return line + (f" ({'; '.join(notes)})" if notes else "")
