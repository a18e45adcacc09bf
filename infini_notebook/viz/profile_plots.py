"""``%%dist_profile``'s figure: a row per rank, its cell split into compute,
communication, waiting for the last peer inside a collective, and idle (the parts add up
to the rank's wall time; core/timeline.py). A rank whose wait could not be measured (no op
matched on its peers) shows none: that time is in its communication. The ranks that waited
are red; the rank that made them wait is mostly grey (idle, or computing), so it is labeled
("arrived last 3/3") for the eye to go to the cause. matplotlib, imported when drawn;
themed like the benchmark figures."""

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


def plot_breakdown(ranks: pd.DataFrame, straggler: tuple[int, int, int] | None = None) -> Figure:
    """``straggler``: (rank, arrived last at, of), labeled at the end of its bar."""
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
        if straggler is not None and straggler[0] in list(ranks["rank"]):
            rank, last, of = straggler
            row = list(ranks["rank"]).index(rank)
            ax.annotate(
                f"arrived last {last}/{of}",
                (left[row], row),
                xytext=(4, 0),
                textcoords="offset points",
                va="center",
                fontsize=8,
                fontweight="bold",
            )
            ax.get_yticklabels()[row].set_fontweight("bold")
            ax.set_xlim(0, max(left) * 1.22)  # room for the label
        ax.invert_yaxis()  # rank 0 on top
        ax.set_xlabel("time in the profiled cell (ms)")
        ax.legend(ncols=4, fontsize=8, loc="lower left", bbox_to_anchor=(0, 1.0), frameon=False)
    return settled_layout(fig)
