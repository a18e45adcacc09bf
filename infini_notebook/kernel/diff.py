"""``%dist_diff``: are the replicas still the same? Each rank describes the leaves of a name
(engine/replica_check.py), the kernel compares them within each group of a kind
(core/replica_diff.py), and only the tensors and numpy arrays that differ are measured, on
the ranks, over their group."""

from __future__ import annotations

from ..core.errors import DistUsageError
from ..core.replica_diff import (
    COLUMNS,
    Comparison,
    compare,
    drop_within,
    measured,
    summary,
    table,
    unreadable,
)
from ..engine import replica_check


def default_kind(layout) -> str:
    """dp (the ranks meant to hold the same values), or world when there is no dp."""
    return "dp" if layout.dp > 1 else "world"


def diff(s, expression: str, kind: str | None = None, atol: float = 0.0):
    """Compare ``expression`` (a tensor, module, optimizer, state dict, nested container,
    object with fields or plain value on each rank) across every group of ``kind``. Returns
    (summary line, DataFrame)."""
    import pandas as pd

    kind = kind or default_kind(s.layout)
    try:
        kind = s.layout.normalize_kind(kind)
    except ValueError as e:
        raise DistUsageError(f"Bad --group {kind!r}: {e}") from None
    groups = s.layout.groups(kind)
    kind = s.layout.kind_label(kind)  # "world", never "tp-cp-dp-pp", in rows and the line
    got = s.apply(replica_check.digests, expression)
    missing = {r: d["missing"] for r, d in got.items() if "missing" in d}
    if missing:
        raise DistUsageError(unreadable(expression, missing))
    comparison = compare({r: d["leaves"] for r, d in got.items()}, groups, kind)
    _measure(s, expression, comparison)
    rows = drop_within(comparison.rows, atol)
    df = pd.DataFrame(table(rows, expression), columns=list(COLUMNS))
    return summary(comparison, rows, kind, len(groups), expression), df


def _measure(s, expression: str, comparison: Comparison) -> None:
    """The largest difference of each leaf whose values differ from its reference rank's
    (for a numpy array also where): the reference sends, the rank compares."""
    if not comparison.transfers:
        return
    s.require_whole()
    # Every rank takes part: a gloo twin for CPU leaves is built on first use, which is
    # collective over all ranks; ranks with nothing to send or receive just return.
    cpu = any(on_cpu for *_, on_cpu in comparison.transfers)
    calls = {
        r: (replica_check.max_diffs, (expression, _involving(comparison, r), cpu))
        for r in range(s.world_size)
    }
    found = s.apply_each(calls, "max_diffs")
    measuring = {path for path, *_ in comparison.transfers}
    for row in comparison.rows:
        if row.leaf in measuring and row.what.startswith("values differ"):
            measured(row, [found[r].get(row.leaf) for r in row.ranks])


def _involving(comparison: Comparison, rank: int) -> list[tuple[str, int, int, bool]]:
    return [t for t in comparison.transfers if rank in t[1:3]]
