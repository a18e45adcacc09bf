"""``%%dist_profile``'s figure: a row per rank, its cell split into compute,
communication, waiting for the last peer inside a collective, and idle (the parts add up
to the rank's wall time; core/timeline.py). A rank whose wait could not be measured (no op
matched on its peers) shows none: that time is in its communication. matplotlib, imported
when drawn; themed like the benchmark figures."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .bench_plots import THEMED_RC, settled_layout

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

PARTS = (
    ("compute_ms", "compute", "#4c78a8"),
    ("communication_ms", "communication", "#59a14f"),
    ("wait_ms", "wait for the last peer", "#e15759"),
    ("idle_ms", "idle", "#bab0ac"),
)


def plot_breakdown(ranks: pd.DataFrame) -> Figure:
    from matplotlib import rc_context
    from matplotlib.figure import Figure

    n = max(len(ranks), 1)
    with rc_context(THEMED_RC):
        fig = Figure(figsize=(7.5, 0.9 + 0.32 * n), layout="constrained")
        ax = fig.subplots()
        labels = [f"rank {r}" for r in ranks["rank"]] if len(ranks) else []
        left = [0.0] * len(ranks)
        for column, label, color in PARTS:
            values = [v if v == v and v is not None else 0.0 for v in ranks[column]]
            ax.barh(labels, values, left=left, color=color, label=label, height=0.7)
            left = [a + b for a, b in zip(left, values)]
        ax.invert_yaxis()  # rank 0 on top
        ax.set_xlabel("time in the profiled cell (ms)")
        ax.legend(ncols=4, fontsize=8, loc="lower left", bbox_to_anchor=(0, 1.0), frameon=False)
    return settled_layout(fig)
