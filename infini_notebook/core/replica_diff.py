"""Which leaves differ between replicas (``%dist_diff``), from what each rank described of
its leaves (engine/replica_check.py: kind, shape, dtype, device, checksum, NaN/Inf, and for
a DTensor its layout and the part it holds; engine/plain_values.py: a plain value's digest,
a numpy array's dtype, shape and digest, the type of an object compared field by field, or
that a value has no value equality). Pure.

Within each group a rank is compared with a reference: for a plain tensor or value the
group's first rank; for a DTensor the group's first rank that holds the same part (the same
coordinates along the mesh dims where it is not Replicate), so that shards are never
compared with other shards. Where a group holds each part of a DTensor once (sharded over
the whole group, as FSDP2 over dp), the group's whole tensor is compared with the first
group's, part by part. A row is one leaf of one group that is not the same on every rank:
missing somewhere, another shape, dtype or layout, other values (the tensors and numpy
arrays whose values differ are then measured on the ranks: ``transfers``), or holding NaN
or Inf. A leaf with no value equality is not compared, and said so (``opaque``).
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
    # each differing rank's reference (the rank it was compared with); none for a leaf
    # missing somewhere or holding NaN/Inf, which is wrong on its own
    against: dict[int, int] = field(default_factory=dict)


@dataclass
class Comparison:
    rows: list[Row] = field(default_factory=list)
    # values to measure, in this order: (leaf, reference rank, rank, over the CPU)
    transfers: list[tuple[str, int, int, bool]] = field(default_factory=list)
    tensors: set[str] = field(default_factory=set)  # tensor leaves
    values: set[str] = field(default_factory=set)  # plain leaves and numpy arrays
    opaque: dict[str, str] = field(default_factory=dict)  # leaf -> type: no value equality
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
                _count(out, path, first)
            if row is None and first["kind"] in MEASURED:
                # NaN or Inf is wrong on its own, and the values are still compared: a NaN
                # row alone hid a replica whose other elements differ
                if bad := _nonfinite(name, path, found):
                    out.rows.append(bad)
                against, how = _references(found, name, first_copy.setdefault(path, {}))
                if how:
                    _note(out.dtensors, path, how, bool(against))
                row = _values_row(name, path, leaves, against)
                for r in row.ranks if row and first.get("sendable", True) else []:
                    ref = against[r][0]
                    on_cpu = "cpu" in (leaves[r][path]["device"], leaves[ref][path]["device"])
                    out.transfers.append((path, ref, r, on_cpu))
            if row is not None:
                out.rows.append(row)
    return out


MEASURED = ("tensor", "ndarray")  # leaves whose differences are measured on the ranks


def _count(out: Comparison, path: str, first: dict) -> None:
    """A leaf counted as a tensor, a value, or not compared; an object's type is not a
    leaf of its own for the count (its fields are)."""
    if first["kind"] == "tensor":
        out.tensors.add(path)
    elif first["kind"] == "opaque":
        out.opaque[path] = first["value"]
    elif first["kind"] != "type":
        out.values.add(path)


def _mismatch(group: str, path: str, found: dict[int, dict | None]) -> Row | None:
    """A row for a leaf missing somewhere, of another kind, shape, dtype or layout, or a
    plain value that differs; None when none of these."""
    ranks = list(found)
    missing = [r for r in ranks if found[r] is None]
    if missing:
        return Row(group, path, missing, "missing on these ranks")
    first = found[ranks[0]]
    for key in ("kind", "shape", "dtype", "layout"):
        odd = [r for r in ranks[1:] if found[r].get(key) != first.get(key)]
        if odd:
            seen = ", ".join(f"{found[r].get(key)}" for r in [ranks[0], *odd])
            return Row(group, path, odd, f"{key} differs: {seen}", against=_first(ranks, odd))
    if first["kind"] not in MEASURED:
        odd = [r for r in ranks[1:] if found[r]["sum"] != first["sum"]]
        if odd:
            values = ", ".join(found[r]["value"] for r in [ranks[0], *odd])
            how = first.get("differs", "value differs (compared by equality)")
            if first["kind"] in ("type", "opaque"):
                how = "type differs"
            return Row(group, path, odd, f"{how}: {values}", against=_first(ranks, odd))
        return None
    return None


def _nonfinite(group: str, path: str, found: dict[int, dict]) -> Row | None:
    """A row for a tensor holding NaN or Inf on some ranks; None when none does."""
    bad = [r for r in found if found[r].get("nan") or found[r].get("inf")]
    if not bad:
        return None
    words = [w for w, k in (("NaN", "nan"), ("Inf", "inf")) if any(found[r].get(k) for r in bad)]
    return Row(group, path, bad, f"{' and '.join(words)} present")


def _first(ranks: list[int], odd: list[int]) -> dict[int, int]:
    return dict.fromkeys(odd, ranks[0])


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
    how = leaves[odd[0]][path].get("differs", "values differ")
    what = " ".join([how, *(f"from {g}" for g in others)])
    return Row(group, path, sorted(odd), what, against={r: against[r][0] for r in sorted(odd)})


def measured(row: Row, found: list) -> None:
    """What the ranks of ``row`` measured, into it: the largest difference (None unless every
    rank measured one); for a numpy array also where (``{"count", "of", "first", "max"}``
    from each rank): "values differ at 1 of 10000 elements, first at [5000]"."""
    largest = [f["max"] if isinstance(f, dict) else f for f in found]
    known = [v for v in largest if v is not None]
    row.max_abs_diff = max(known) if known and len(known) == len(largest) else None
    where = [_where(f) for f in found if isinstance(f, dict)]
    if not where or len(where) != len(row.ranks):
        return
    if len(where) == 1:
        row.what = f"{row.what} at {where[0]}"
    else:
        each = "; ".join(f"{rank_label([r])[1:-1]} at {w}" for r, w in zip(row.ranks, where))
        row.what = f"{row.what}: {each}"


def _where(found: dict) -> str:
    """'1 of 10000 elements, first at [5000]'."""
    text = f"{found['count']} of {count(found['of'], 'element')}"
    if found["of"] > 1:
        text += f", first at [{', '.join(map(str, found['first']))}]"
    return text


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


def summary(
    comparison: Comparison, rows: list[Row], kind: str, ngroups: int, expression: str = ""
) -> str:
    """'all 24 tensors identical across 2 dp groups', or how many leaves differ where; and,
    for DTensors, what was compared; what was not compared (no value equality), by its
    path in ``expression``."""
    groups = count(ngroups, f"{kind} group")
    how = list(comparison.dtensors.values())
    compared = len(comparison.tensors) - how.count("once")
    parts = [count(compared, "tensor")] if compared or not comparison.values else []
    if comparison.values:
        parts.append(count(len(comparison.values), "other value" if parts else "value"))
    leaves = " and ".join(parts)
    if rows:
        bad_groups = len({r.group for r in rows})
        line = f"{count(len(rows), 'difference')} in {bad_groups} of {groups} (of {leaves} each)"
    elif compared + len(comparison.values) == 1:
        line = f"{leaves} identical across {groups}"
    elif compared or comparison.values:
        line = f"all {leaves} identical across {groups}"
    else:
        line = f"nothing to compare across {groups}"
    notes = []
    if how.count("parts"):
        notes.append(f"{count(how.count('parts'), 'DTensor')} compared between ranks holding "
                     "the same part")  # fmt: skip
    if how.count("groups"):
        notes.append(
            f"{count(how.count('groups'), 'DTensor')} sharded over each {kind} group: each "
            "group's whole tensor compared with the first group's"
        )
    if how.count("once"):
        notes.append(
            f"{count(how.count('once'), 'DTensor')} with each part on one rank only: not compared"
        )
    if comparison.opaque:
        notes.append(not_compared(comparison.opaque, expression))
    return line + (f" ({'; '.join(notes)})" if notes else "")


def not_compared(opaque: dict[str, str], expression: str, shown: int = 3) -> str:
    """'not compared: lock (_thread.lock) has no value equality': the first few leaves by
    their path, and how many more."""
    names = [f"{path or expression} ({t})" for path, t in sorted(opaque.items())]
    more = len(names) - shown
    listed = ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")
    return f"not compared: {listed} {'has' if len(names) == 1 else 'have'} no value equality"


def count(n: int, noun: str) -> str:
    """'1 tensor', '4 tensors'."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


COLUMNS = ("group", "leaf", "ranks", "compared_with", "max_abs_diff", "what")


def table(rows: list[Row], expression: str) -> list[tuple]:
    """The table's rows (COLUMNS): the leaf by its path in ``expression``, or by the name
    itself for a plain tensor or value; the ranks that differ; the ranks they were compared
    with ("-" where the leaf is wrong on its own: missing, NaN or Inf)."""
    out = []
    for r in rows:
        refs = sorted(set(r.against.values()))
        against = rank_label(refs)[1:-1] if refs else "-"
        leaf = r.leaf or expression
        out.append((r.group, leaf, rank_label(r.ranks)[1:-1], against, r.max_abs_diff, r.what))
    return out
