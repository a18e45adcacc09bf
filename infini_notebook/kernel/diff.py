"""``%dist_diff``: are the replicas still the same? Each rank describes the leaves of a name
(engine/replica_check.py), the kernel compares them within each group of a kind
(core/replica_diff.py), and only the tensors that differ are measured, on the ranks, over
their group."""

from __future__ import annotations

from ..core.errors import DistUsageError
from ..core.ranks import rank_label
from ..core.replica_diff import Comparison, compare, drop_within, summary
from ..engine import replica_check


def default_kind(layout) -> str:
    """dp (the ranks meant to hold the same values), or world when there is no dp."""
    return "dp" if layout.dp > 1 else "world"


def diff(s, expression: str, kind: str | None = None, atol: float = 0.0):
    """Compare ``expression`` (a tensor, module, optimizer, state dict or nested container
    on each rank) across every group of ``kind``. Returns (summary line, DataFrame)."""
    import pandas as pd

    kind = kind or default_kind(s.layout)
    try:
        kind = s.layout.normalize_kind(kind)
    except ValueError as e:
        raise DistUsageError(f"Bad --group {kind!r}: {e}") from None
    groups = s.layout.groups(kind)
    got = s.apply(replica_check.digests, expression)
    missing = {r: d["missing"] for r, d in got.items() if "missing" in d}
    if missing:
        where = "; ".join(f"{rank_label([r])[1:-1]}: {why}" for r, why in sorted(missing.items()))
        raise DistUsageError(f"{expression!r} cannot be read on every rank ({where}).")
    comparison = compare({r: d["leaves"] for r, d in got.items()}, groups, kind)
    _measure(s, expression, kind, comparison)
    rows = drop_within(comparison.rows, atol)
    df = pd.DataFrame(
        [(r.group, r.leaf, rank_label(r.ranks)[1:-1], r.max_abs_diff, r.what) for r in rows],
        columns=["group", "leaf", "ranks", "max_abs_diff", "what"],
    )
    return summary(comparison, rows, kind, len(groups)), df


def _measure(s, expression: str, kind: str, comparison: Comparison) -> None:
    """The largest difference of each leaf whose values differ, against the group's first
    rank: the ranks of a group with such leaves broadcast and compare, over the group."""
    if not comparison.measure:
        return
    s.require_whole()
    # Every rank takes part: groups.get(kind) builds a kind's groups on first use, which
    # is collective over all ranks; ranks with nothing to measure just return.
    plan = {r: (group, paths) for _, group, paths in comparison.measure for r in group}
    calls = {
        r: (replica_check.max_diffs, (expression, kind, *plan.get(r, ([], []))))
        for r in range(s.world_size)
    }
    found = s.apply_each(calls, "max_diffs")
    for row in comparison.rows:
        if row.what == "values differ":
            values = [found[r][row.leaf] for r in row.ranks if row.leaf in found.get(r, {})]
            row.max_abs_diff = max(values) if values else None
